"""Structured output and tool calls at the producer: bad schemas and tool fields are 400s before
anything is queued; the constraint reaches the worker; calls come back in OpenAI's shape, whole and
streamed, through the official client (the fake worker plays the model)."""

from __future__ import annotations

import asyncio
import json

import pytest
import xgrammar as xgr

from producer.api.structured import json_value, pattern_cost
from shared.schemas import RequestStatus

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def chat(**extra):
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **extra}


CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"


def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def native(**parameters):
    return {"inputs": "a", "parameters": parameters}


BAD_OBJECT = {"properties": 5, "type": "object"}
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
UNKNOWN = {"type": "function", "function": {"name": "nope"}}
BAD = [
    (CHAT, chat(response_format=schema_format({"type": "foo"})), "response_format", "invalid_json_schema"),
    (CMPL, {"model": MODEL, "prompt": "a", "response_format": schema_format(BAD_OBJECT)}, "response_format", "invalid_json_schema"),  # noqa: E501
    (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema", "invalid_response_format"),
    (CHAT, chat(tool_choice="auto"), "tool_choice", "invalid_tool_choice"),
    (CHAT, chat(tools=[WEATHER], tool_choice=UNKNOWN), "tool_choice", "invalid_tool_choice"),
    # An object's error names its own field (it was told "Input should be 'none', 'auto' or 'required'")
    (CHAT, chat(tools=[WEATHER], tool_choice={"type": "function", "function": {}}), "tool_choice.function.name", None),
    (CHAT, chat(tools=[WEATHER], tool_choice="maybe"), "tool_choice", None),
    (CHAT, chat(functions=[WEATHER["function"]]), "functions", "unsupported_parameter"),
    (CHAT, chat(function_call="auto"), "functions", "unsupported_parameter"),
    (CHAT, chat(tools=[BAD_TOOL]), "tools.0.function.parameters", "invalid_json_schema"),
    (CHAT, chat(tools=[WEATHER], tool_choice=NAMED, response_format={"type": "json_object"}), "response_format", "invalid_response_format"),  # noqa: E501
    (GEN, native(regular_constraint="(abc"), "parameters.regular_constraint", "invalid_regex"),
    (GEN, native(guided_json={"type": "foo"}), "parameters.guided_json", "invalid_json_schema"),
    (GEN, native(guided_grammar="root ::= nothing"), "parameters.guided_grammar", "invalid_ebnf"),
    (GEN, native(guided_json={}, regular_constraint="a"), "parameters.regular_constraint", None),
    (GEN, native(regular_constraint="a+", min_new_tokens=3), "parameters.min_new_tokens", "unsupported_parameter"),
    (CHAT, chat(response_format={"type": "json_object"}, min_tokens=2), "min_tokens", "unsupported_parameter"),
    (CHAT, chat(tools=[WEATHER], tool_choice="required", min_tokens=2), "min_tokens", "unsupported_parameter"),
    (CMPL, {"model": MODEL, "prompt": "a", "response_format": {"type": "json_object"}, "min_tokens": 1}, "min_tokens", "unsupported_parameter"),  # noqa: E501
    # Other servers' fields (producer.api.guided): checked as lightq's own, never ignored
    (CHAT, chat(guided_regex="(abc"), "guided_regex", "invalid_regex"),
    (CMPL, {"model": MODEL, "prompt": "a", "regex": "(abc"}, "regex", "invalid_regex"),
    (CHAT, chat(guided_json={"type": "foo"}), "guided_json", "invalid_json_schema"),
    (CHAT, chat(json_schema='{"type": "foo"}'), "json_schema", "invalid_json_schema"),
    (CHAT, chat(guided_grammar="root ::= nothing"), "guided_grammar", "invalid_ebnf"),
    (CHAT, chat(structured_outputs={"grammar": "root ::= nothing"}), "structured_outputs.grammar", "invalid_ebnf"),
    (CHAT, chat(guided_json={}, guided_regex="a"), "guided_regex", None),
    (CHAT, chat(structured_outputs={"choice": ["a"], "regex": "a"}), "structured_outputs.choice", None),
    (CHAT, chat(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice", None),
    (CHAT, chat(tools=[WEATHER], tool_choice="required", guided_json={}), "guided_json", "invalid_response_format"),
    (CHAT, chat(guided_json={}, guided_whitespace_pattern=" "), "guided_whitespace_pattern", "unsupported_parameter"),  # noqa: E501
    (CHAT, chat(structural_tag="{}"), "structural_tag", "unsupported_parameter"),
    (CHAT, chat(structured_outputs={"structural_tag": "{}"}), "structured_outputs.structural_tag", "unsupported_parameter"),  # noqa: E501
    (CHAT, chat(guided_choice=[]), "guided_choice", None),
    # Cost bounds, before anything parses (a 400-level JSON text took xgrammar 42 s)
    (CHAT, chat(guided_json="[" * 400 + "]" * 400), "guided_json", "schema_too_deep"),
    (GEN, native(guided_json='{"a":' * 65 + "1" + "}" * 65), "parameters.guided_json", "schema_too_deep"),
    (CHAT, chat(guided_regex="a" * 200_001), "guided_regex", "constraint_too_large"),
    # ... and 7 s for one pattern of [a-z]{3,6400}: a pattern's counts cost their square
    (CHAT, chat(guided_json={"type": "string", "pattern": "[a-z]{3,2001}"}), "guided_json", "constraint_too_costly"),
    (GEN, native(guided_json={"type": "object", "patternProperties": {"^a{2001}$": {}}}), "parameters.guided_json", "constraint_too_costly"),  # noqa: E501
    (CHAT, chat(guided_json={"anyOf": [{"pattern": "x{1000,}"}] * 5}), "guided_json", "constraint_too_costly"),
    # each tool just within the cost, all of them far past it: 21 s of the producer's CPU (red team 5)
    (CHAT, chat(tools=[tool(f"t{n}", {"type": "object", "properties": {"a": {"pattern": "^[a-z]{1,1999}$"}}}) for n in range(60)]), "tools", "constraint_too_costly"),  # noqa: E501
    (CHAT, chat(tools=[tool(f"t{n}", {"type": "object", "description": "x" * 4_000}) for n in range(60)]), "tools", "constraint_too_large"),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD, ids=[f"{b[0]}:{b[2]}:{n}" for n, b in enumerate(BAD)])
async def test_bad_structure_is_a_400_before_anything_is_queued(client, aredis, keys, path, body, param, code):
    response = await client.post(path, content=json.dumps(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code), error
    assert await aredis.xlen(keys.requests()) == 0


def test_a_patterns_cost_is_its_counts_squared_wherever_the_schema_holds_it():
    schema = {
        "properties": {"a": {"pattern": "^[a-z]{3,20}-\\d{4}$"}, "b": {"items": {"pattern": "x{7,}"}}},
        "patternProperties": {"^k{5}$": {"pattern": "y{2,3}z{1000}"}},
        "anyOf": [{"pattern": 5}, {"description": "{9}"}],  # not a regex: no cost
    }
    assert pattern_cost(schema) == 20**2 + 4**2 + 7**2 + 5**2 + 3**2 + 1000**2
    assert pattern_cost(json_value('"x"')) == pattern_cost(json_value("not json")) == 0


async def test_a_pattern_at_the_cost_bound_is_parsed_and_queued(oai, worker):
    """2000 squared is the default bound itself: accepted (2001 is refused above)."""
    schema = {"type": "string", "pattern": "[a-z]{3,2000}"}
    async with worker.answering(reply_with(['"abc"'])) as seen:
        out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"guided_json": schema})
    assert out.choices[0].message.content == '"abc"'
    assert [r.params.constraint.spec for r in seen] == [json.dumps(schema)]


def reply_with(texts):
    return lambda request: (texts, "stop")


async def test_response_format_reaches_the_worker_as_a_constraint(oai, worker, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with worker.answering(reply_with(['{"a": 1}'])) as seen:
        fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
        out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt)
        await oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
        await oai.completions.create(model=MODEL, prompt="x", extra_body={"response_format": fmt})  # a lightq extra
        native = await client.post(
            "/generate", content=json.dumps({"inputs": "x", "parameters": {"regular_constraint": "[ab]+"}})
        )
    assert json.loads(out.choices[0].message.content) == {"a": 1}
    assert native.status_code == 200
    sent = [r.params.constraint for r in seen]
    assert [(c.kind, c.spec) for c in sent] == [
        ("json_schema", json.dumps(schema)),
        ("json", ""),
        ("json_schema", json.dumps(schema)),
        ("regex", "[ab]+"),
    ]
    # each with the producer's parse, which the worker compiles as it is
    parse = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    assert [c.grammar for c in sent] == [parse, "", parse, str(xgr.Grammar.from_regex("[ab]+"))]


async def test_a_named_function_is_a_constrained_call_whole_and_streamed(oai, worker):
    texts = ['{"city": ', '"Paris"}']
    async with worker.answering(reply_with(texts)) as seen:
        out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED)
        stream = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=NAMED, stream=True
        )
        events = [e async for e in stream]
    assert (seen[0].params.constraint.kind, seen[0].params.constraint.spec) == ("json_schema", json.dumps(CITY))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [e.choices[0].delta for e in events if e.choices]
    assert deltas[0].tool_calls[0].function.name == "get_weather" and deltas[0].tool_calls[0].id.startswith("call_")
    streamed = "".join(d.tool_calls[0].function.arguments for d in deltas if d.tool_calls)
    assert streamed == "".join(texts)
    assert events[-1].choices[0].finish_reason == "tool_calls"


async def test_required_and_auto_read_calls_off_the_output(oai, worker, tokenizer):
    calls = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    tagged = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    replies = iter([[calls], [tagged], ["It is sunny."], [tagged], [calls]])
    async with worker.answering(lambda request: (next(replies), "stop")) as seen:
        required = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False
        )
        auto = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK])
        text = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK])
        stream = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK], stream=True)
        events = [e async for e in stream]
        parallel = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, CLOCK])
    assert [c.function.name for c in parallel.choices[0].message.tool_calls] == ["get_weather", "get_time"]
    schema = json.loads(seen[0].params.constraint.spec)
    call, array = schema["anyOf"]  # one call, or an array of them (of one: parallel_tool_calls false)
    assert len(call["anyOf"]) == 2 and array["items"] == call and array["maxItems"] == 1
    assert seen[1].params.constraint is None  # auto: free text
    assert "get_weather" in tokenizer.decode(seen[1].prompt_ids)  # the tools described to the model
    # (the fake model ignores maxItems: parallel_tool_calls false keeps the first call)
    assert [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert auto.choices[0].message.tool_calls[0].function.name == "get_time"
    assert auto.choices[0].finish_reason == "tool_calls"
    assert text.choices[0].message.content == "It is sunny." and text.choices[0].message.tool_calls is None
    deltas = [e.choices[0].delta for e in events if e.choices and e.choices[0].delta.tool_calls]
    assert [d.tool_calls[0].function.name for d in deltas] == ["get_time"]
    assert events[-1].choices[0].finish_reason == "tool_calls"


async def test_a_tool_round_trip_goes_through_the_chat_template(oai, worker, tokenizer):
    async with worker.answering(reply_with(["It is 21 C."])) as seen:
        messages = [
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        ]
        out = await oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none")
    assert out.choices[0].message.content == "It is 21 C." and out.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(seen[0].prompt_ids)
    assert "21 C, sunny" in prompt and '"get_weather"' in prompt  # the call as text, the result as a tool turn
    assert "You can call these functions" not in prompt  # none: the tools are not offered


async def test_an_auto_answer_that_is_not_a_call_streams_as_content(oai, worker):
    async with worker.answering(reply_with([" It", " is", " sunny."])):
        stream = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER], stream=True)
        events = [e async for e in stream]
    contents = [e.choices[0].delta.content for e in events if e.choices and e.choices[0].delta.content]
    assert contents == [" It", " is", " sunny."]  # as they come, not held to the end
    assert events[-1].choices[0].finish_reason == "stop"
    assert not any(e.choices and e.choices[0].delta.tool_calls for e in events)


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        ("constraint_too_costly: the json_schema constraint was not compiled in 30 s", 400, "constraint_too_costly"),
        ("invalid_constraint: the regex constraint: bad", 400, "invalid_constraint"),
        ("CUDA out of memory", 500, "generation_failed"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_constraint_the_worker_cannot_apply_is_the_clients_400(oai, worker, error, status, code, stream):
    """A constraint that did not compile in time (or at all) on the worker is the client's to change:
    a 400 with its code (it was a 500 generation_failed); a failure of the worker's own stays a 500."""

    async def fail_next():
        request = await worker.take()
        await worker.end(request.id, 0, RequestStatus.FAILED, "error", error=error)

    task = asyncio.create_task(fail_next())
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": CITY}}
    if not stream:
        with pytest.raises(openai.APIStatusError) as raised:
            await oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt)
        await task
        body = raised.value.body
        assert (raised.value.status_code, body["code"], body["message"]) == (status, code, error)
        return
    events = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, stream=True)
    with pytest.raises(openai.APIError) as raised:
        _ = [e async for e in events]
    await task
    kind = "invalid_request_error" if status == 400 else "server_error"
    assert (raised.value.body["code"], raised.value.body["type"], raised.value.body["message"]) == (code, kind, error)
