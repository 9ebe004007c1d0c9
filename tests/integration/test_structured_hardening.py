"""Structured output against one real ``lightq serve`` (producer, router, one worker on the embedded
SmolLM2, the test's Redis) through the official openai client: issue 33 items 1-3 and 9's bounds,
issue 34 item 3.

- ``tool_choice: "required"`` with vLLM's own test tools (``get_current_weather``'s parameters
  reach a ``$defs`` object through ``$ref``) calls a tool, whole and streamed (it was a 500).
- A ``required`` call cut short by ``max_tokens`` has empty content, never the grammar's raw JSON.
- vLLM's and SGLang's constraint fields sent through ``extra_body`` are honoured (they were dropped).
- A schema nested past ``--max_schema_depth`` or longer than ``--max_schema_chars`` is a 400 naming
  the limit, through every field that takes one, answered at once (a 400-level schema as a JSON
  string took xgrammar 42 s to parse, twice); the worker compiles each accepted schema once.
- A schema whose patterns' counts cost more than ``--max_schema_pattern_cost`` is refused at once; one
  under it that takes minutes to compile ends with a 400 after the worker's compile bound, holding up
  no one.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.stack import COMPILE_TIMEOUT_S

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# vLLM's tools of tests/entrypoints/openai/test_completion_with_function_calling.py (the issue's
# reproduction): the first one's "options" is a $ref to its own $defs.
WEATHER_OPTIONS = {
    "title": "WeatherOptions",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius", "title": "Unit"},
        "include_forecast": {"type": "boolean", "default": False, "title": "Include Forecast"},
        "language": {"type": "string", "default": "zh-CN", "title": "Language", "enum": ["zh-CN", "en-US", "ja-JP"]},
    },
}
VLLM_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "description": "Get the current weather in a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. 'Vienna'", "default": "Vienna"},
                    "country": {"type": "string", "description": "The country that the city is in"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "options": {"$ref": "#/$defs/WeatherOptions", "description": "Optional parameters"},
                },
                "required": ["country", "unit"],
                "$defs": {"WeatherOptions": WEATHER_OPTIONS},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_forecast",
            "description": "Get the weather forecast for a given location",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "default": "Vienna"},
                    "country": {"type": "string"},
                    "days": {"type": "integer", "description": "Number of days (1-7)"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["country", "days", "unit"],
            },
        },
    },
]
VLLM_MESSAGES = [
    {"role": "user", "content": "Hi! How are you doing today?"},
    {"role": "assistant", "content": "I'm doing well! How can I help you?"},
    {
        "role": "user",
        "content": "Can you tell me what the current weather is in Berlin and the forecast for the next 5 days, "
        "in fahrenheit?",
    },
]
ASK = [{"role": "user", "content": "Answer in one word: is the sky blue?"}]


@pytest.fixture
def stack(smollm2_single_stack):
    return smollm2_single_stack  # tests/integration/conftest.py's smollm2_single, shared with test_structured_stack.py


@pytest.fixture
def oai(stack):
    with openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def model_id(oai) -> str:
    return oai.models.list().data[0].id


def check_calls(calls) -> None:
    """Each call names one of vLLM's tools and its arguments follow that tool's parameters."""
    assert calls, "no call"
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert call.function.name in ("get_current_weather", "get_forecast")
        assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["country"], str)
        if "options" in arguments:  # the $ref'd object: only its own keys
            assert set(arguments["options"]) <= set(WEATHER_OPTIONS["properties"]), arguments


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_with_vllms_tools_and_their_defs_calls_a_tool(oai, stream):
    """Issue 33 item 1: the tools' "$ref": "#/$defs/WeatherOptions" pointed nowhere once the tools'
    parameters sat inside ``required``'s grammar; the worker failed it with a 500."""
    request = dict(
        model=model_id(oai),
        messages=VLLM_MESSAGES,
        tools=VLLM_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        temperature=0,
    )
    if not stream:
        choice = oai.chat.completions.create(**request).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)
        return
    events = list(oai.chat.completions.create(**request, stream=True))
    deltas = [d for e in events if e.choices for d in e.choices[0].delta.tool_calls or []]
    assert events[-1].choices[0].finish_reason == "tool_calls"
    check_calls(deltas)


def test_a_tool_whose_ref_points_nowhere_is_a_400_naming_it(oai):
    broken = json.loads(json.dumps(VLLM_TOOLS))
    del broken[0]["function"]["parameters"]["$defs"]
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(model=model_id(oai), messages=ASK, tools=broken, tool_choice="required")
    error = raised.value.body
    assert error["param"] == "tools.0.function.parameters" and error["code"] == "invalid_json_schema", error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_cut_short_has_empty_content(oai, stream):
    """Issue 33 item 2: cut inside its first call, a required answer's content was the grammar's raw
    JSON ('{"name": "get_weather", "arguments": {"'); now empty, as vLLM answers."""
    request = dict(model=model_id(oai), messages=VLLM_MESSAGES, tools=VLLM_TOOLS, tool_choice="required", max_tokens=4)
    if not stream:
        choice = oai.chat.completions.create(**request).choices[0]
        assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("length", "", None)
        return
    events = list(oai.chat.completions.create(**request, stream=True))
    assert events[-1].choices[0].finish_reason == "length"
    assert not [e for e in events if e.choices and (e.choices[0].delta.content or e.choices[0].delta.tool_calls)]


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def a_person(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"name", "age"} and len(value["name"]) <= 12 and 0 <= value["age"] <= 120


def one_of(*texts):
    return lambda text: text in texts


def matches(pattern):
    return lambda text: re.fullmatch(pattern, text) is not None


OTHER_SERVERS = [
    ({"guided_choice": ["yes", "no"]}, one_of("yes", "no")),
    ({"structured_outputs": {"choice": ["red sky", "blue sky"]}}, one_of("red sky", "blue sky")),
    ({"guided_regex": "[0-9]{3}"}, matches("[0-9]{3}")),
    ({"regex": "(cat|dog)s?"}, matches("(cat|dog)s?")),
    ({"structured_outputs": {"regex": "[A-Z][a-z]{2}"}}, matches("[A-Z][a-z]{2}")),
    ({"guided_grammar": 'root ::= "v" [0-9] [0-9]'}, matches("v[0-9]{2}")),
    ({"ebnf": 'root ::= ("ab" | "cd") "!"'}, one_of("ab!", "cd!")),
    ({"structured_outputs": {"grammar": 'root ::= "x" | "y"'}}, one_of("x", "y")),
    ({"guided_json": PERSON}, a_person),
    ({"guided_json": json.dumps(PERSON)}, a_person),
    ({"json_schema": json.dumps(PERSON)}, a_person),
    ({"structured_outputs": {"json": PERSON}}, a_person),
]


@pytest.mark.parametrize(("extra", "follows"), OTHER_SERVERS, ids=[json.dumps(e)[:40] for e, _ in OTHER_SERVERS])
def test_other_servers_constraint_fields_are_honoured(oai, extra, follows):
    """Issue 33 item 3: vLLM's and SGLang's fields, as their users send them (the openai client's
    extra_body), were dropped: the answer was free text. Now each constrains it, on chat and on
    completions."""
    model = model_id(oai)
    chat = oai.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0, extra_body=extra)
    assert chat.choices[0].finish_reason == "stop" and follows(chat.choices[0].message.content), chat.choices[0]
    done = oai.completions.create(model=model, prompt="Q: ", max_tokens=60, temperature=0, extra_body=extra)
    assert done.choices[0].finish_reason == "stop" and follows(done.choices[0].text), done.choices[0]


def nested(levels: int, nonce: str = "") -> dict:
    """An object schema nested ``levels`` deep (two JSON levels each: properties, the property)."""
    schema: dict = {"type": "string", "description": nonce}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def fields(schema: dict, as_text: bool) -> list[tuple[str, str, dict]]:
    """Every field that carries a schema: (path, param named in its error, body)."""
    text = json.dumps(schema)
    value = text if as_text else schema
    chat = {"model": "m", "messages": ASK, "max_tokens": 1}
    cmpl = {"model": "m", "prompt": "Q: ", "max_tokens": 1}
    out = [
        ("/v1/chat/completions", "guided_json", {**chat, "guided_json": value}),
        ("/v1/completions", "guided_json", {**cmpl, "guided_json": value}),
        (
            "/generate",
            "parameters.guided_json",
            {"inputs": "Q: ", "parameters": {"max_new_tokens": 1, "guided_json": value}},
        ),  # noqa: E501
        ("/v1/chat/completions", "structured_outputs.json", {**chat, "structured_outputs": {"json": value}}),
    ]
    if as_text:
        return [*out, ("/v1/chat/completions", "json_schema", {**chat, "json_schema": text})]
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return [
        *out,
        ("/v1/chat/completions", "response_format", {**chat, "response_format": response_format}),
        ("/v1/completions", "response_format", {**cmpl, "response_format": response_format}),
        ("/v1/chat/completions", "tools.0.function.parameters", {**chat, "tools": [tool], "tool_choice": "required"}),
    ]


def post(stack, path: str, body: dict, model: str) -> tuple[httpx.Response, float]:
    if "model" in body:
        body = {**body, "model": model}
    started = time.perf_counter()
    response = httpx.post(f"{stack.http}{path}", json=body, timeout=10)  # the old parse took 42 s
    return response, time.perf_counter() - started


@pytest.mark.parametrize(
    ("levels", "as_text"), [(70, False), (400, True)], ids=["object 70 levels", "JSON text 400 levels"]
)
def test_a_schema_nested_past_the_bound_is_a_400_naming_it_through_every_field(stack, oai, levels, as_text):
    """Issue 34 item 3: a schema as a JSON string stepped around the body's nesting limit, and
    xgrammar's parse of 400 levels took 42 s (paid again by the worker). Every field is bounded now,
    before anything parses the schema; the answer comes at once (printed: run with -s)."""
    model = model_id(oai)
    for path, param, body in fields(nested(levels), as_text):
        response, seconds = post(stack, path, body, model)
        print(f"{path} {param}: {response.status_code} in {seconds * 1000:.0f} ms")
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "schema_too_deep"), error
        assert "max_schema_depth (64)" in error["message"]


def test_a_schema_past_the_size_bound_is_a_400_naming_it(stack, oai):
    huge = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(10_000)}}
    for path, param, body in fields(huge, as_text=True)[:3]:
        response, _ = post(stack, path, body, model_id(oai))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["param"], error["code"]) == (param, "constraint_too_large")
        assert "max_schema_chars (200000)" in error["message"]


def compiles(stack) -> int:
    return stack.test_log().count("compiled a json_schema grammar")


def test_the_worker_compiles_each_accepted_schema_once(stack, oai):
    """Accepted schemas through every field, each field its own schema (a nonce), each sent twice:
    the worker compiled each once (its log line per finished compile), from the producer's parse."""
    model = model_id(oai)
    sent = set()
    for as_text in (False, True):
        for path, param, body in fields(nested(3), as_text):
            nonce = uuid.uuid4().hex
            own = fields(nested(3, nonce), as_text)
            body = next(b for p, q, b in own if (p, q) == (path, param))
            for _ in range(2):
                response, _ = post(stack, path, body, model)
                assert response.status_code == 200, response.text
            sent.add(nonce)
    deadline = time.monotonic() + 30  # serve copies the worker's log lines as they come
    while compiles(stack) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert compiles(stack) == len(sent)


def patterns(nonce: str, count: int, low: int, high: int) -> dict:
    """``count`` counted string patterns, new to every cache: ``[a-z]{3,low+i}-[0-9]{2,high+i}``."""
    props = {
        f"p{i}_{nonce}": {"type": "string", "pattern": f"[a-z]{{3,{low + i}}}-[0-9]{{2,{high + i}}}"}
        for i in range(count)
    }
    return {"type": "object", "properties": props, "required": list(props)}


def costly(nonce: str) -> dict:
    """Cheap for the producer's parse (its patterns cost ~2e6 of max_schema_pattern_cost's 4e6, ~0.2 s)
    and a minute or more for the worker's compile (60 such patterns took 39 s on a 2-core machine)."""
    return patterns(nonce, 100, 60, 30)


def test_a_schema_too_costly_to_parse_is_refused_at_once(stack, oai):
    """A thousand patterns of a few hundred counts: a minute of the producer's parse (30-60 s of CPU on a
    2-core machine, before the bound) is refused in microseconds, naming the bound."""
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(
            model=model_id(oai), messages=ASK, max_tokens=5, extra_body={"guided_json": patterns("x", 1000, 100, 50)}
        )
    assert refused.value.body["code"] == "constraint_too_costly", refused.value.body
    assert "max_schema_pattern_cost (4000000)" in refused.value.body["message"]
    print(f"refused in {time.monotonic() - started:.3f} s")


def test_a_schema_too_costly_to_compile_is_a_400_and_holds_up_no_one(stack, oai):
    """Issue 33 item 9: two schemas that take minutes to compile, then a cheap schema and a plain
    request. The cheap one compiles and the plain one runs while they compile (the worker keeps a
    compile process from slow compiles); each costly one ends after --grammar_compile_timeout_s (10 s
    on this stack: ``tests.integration.stack.COMPILE_TIMEOUT_S``; the costly schema took 25-39 s to
    compile on 2-core machines, and under serve's default 30 s on the fastest, which then answered it)
    with a 400 ``constraint_too_costly``, not a 500 (before, the cheap one waited behind them and
    timed out too, with a 500)."""
    model = model_id(oai)

    def ask(client=oai, **extra):
        try:
            return client.chat.completions.create(model=model, messages=ASK, max_tokens=60, temperature=0, **extra)
        except openai.APIStatusError as exc:
            return exc

    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(ask, extra_body={"guided_json": costly(uuid.uuid4().hex)}) for _ in range(2)]
        cheap = pool.submit(ask, extra_body={"guided_json": {**PERSON, "title": uuid.uuid4().hex}})
        plain = pool.submit(ask)
        assert a_person(cheap.result().choices[0].message.content)
        assert plain.result().choices[0].finish_reason in ("stop", "length")
        for refused in (f.result() for f in slow):
            assert isinstance(refused, openai.BadRequestError), refused
            assert (
                refused.body["code"] == "constraint_too_costly"
                and f"within {COMPILE_TIMEOUT_S} s" in refused.body["message"]
            )
