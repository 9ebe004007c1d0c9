"""Structured output and tool calls with the official ``openai`` client against ``lightq serve``
(producer, router, one worker on the embedded SmolLM2): sampled JSON-schema answers all parse and
validate, a forced tool call round trip, and a named call's arguments streamed as deltas."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.stack import start_stack

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colours"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(tmp_path_factory, redis_url):
    log = str(tmp_path_factory.mktemp("structured-stack") / "serve.log")
    prefix = f"lightq-structured-{uuid.uuid4().hex[:8]}"
    extra = ["--max_total_token_num", "8192", "--max_req_total_len", "1024"]
    stack = start_stack(log, redis_url=redis_url, prefix=prefix, workers=1, extra=extra)
    try:
        with openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            yield client
        assert stack.stop() == 0, open(log).read()[-3000:]
    finally:
        stack.remove_keys()


def valid_person(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"name", "age", "colours"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 20
        and type(value["age"]) is int
        and 0 <= value["age"] <= 130
        and len(value["colours"]) <= 3
        and set(value["colours"]) <= {"red", "green", "blue"}
    )


def test_sampled_json_schema_answers_all_validate(oai):
    model = oai.models.list().data[0].id
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(i: int):
        messages = [{"role": "user", "content": f"Invent person number {i} as JSON."}]
        return oai.chat.completions.create(
            model=model, messages=messages, temperature=1.0, max_tokens=120, response_format=fmt
        ).choices[0]

    with ThreadPoolExecutor(16) as pool:
        choices = list(pool.map(ask, range(16)))
    assert [c.finish_reason for c in choices] == ["stop"] * 16
    assert all(valid_person(c.message.content) for c in choices), [c.message.content for c in choices]


def test_a_forced_tool_call_round_trip(oai):
    model = oai.models.list().data[0].id
    out = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages = [*ASK, choice.message, {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    answer = oai.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=30)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # One call, greedy: with parallel calls allowed, or sampled at temperature 1, SmolLM2's array of
    # calls sometimes ran past max_tokens (CI: "length")
    required = oai.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        temperature=0,
    )
    assert required.choices[0].finish_reason == "tool_calls", required.choices[0].message
    assert all(c.function.name == "get_weather" for c in required.choices[0].message.tool_calls)


def test_a_named_calls_arguments_stream_as_deltas(oai):
    model = oai.models.list().data[0].id
    stream = oai.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=60, stream=True
    )
    events = list(stream)
    calls = [e.choices[0].delta.tool_calls[0] for e in events if e.choices and e.choices[0].delta.tool_calls]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert len(calls) > 2  # the arguments arrive piece by piece
    assert isinstance(json.loads("".join(c.function.arguments or "" for c in calls))["city"], str)
    assert events[-1].choices[0].finish_reason == "tool_calls"


def test_echo_logprobs_equal_a_reference_forward(oai):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) against transformers' forward of
    the same GGUF: every prompt token's logprob within 1e-3."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from shared.model_files import load_tokenizer, resolve

    source = resolve("default")
    ids = load_tokenizer(source).encode("The capital of France is Paris, and the capital of Italy is Rome.")
    model = oai.models.list().data[0].id
    out = oai.completions.create(model=model, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    logprobs = out.choices[0].logprobs
    assert out.usage.completion_tokens == 0 and len(logprobs.token_logprobs) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    folder, name = os.path.split(source.path)
    ref = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(logp[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    best = [float(logp[p].max()) for p in range(len(ids) - 1)]
    assert [max(top.values()) for top in logprobs.top_logprobs[1:]] == pytest.approx(best, abs=1e-3)
