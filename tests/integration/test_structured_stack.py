"""Structured output, tool calls and prompt logprobs with real clients against one ``lightq serve``
(producer, router, one worker on the embedded SmolLM2): the official ``openai`` client (sampled
JSON-schema answers all parse and validate, tool call round trips, a named call's arguments
streamed as deltas, echo logprobs against a reference forward), LangChain's ``bind_tools``, and
lm-eval's ``local-completions`` against its own ``hf`` backend on the same weights."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from producer.api.tools import CALLS_PER_TOOL

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


@pytest.fixture
def hf_dir(smollm2_hf_dir) -> str:
    """The embedded GGUF as a Hugging Face directory, by transformers (tests/conftest.py): the
    reference forward and lm-eval's hf backend load it in a second."""
    return smollm2_hf_dir


@pytest.fixture
def oai(smollm2_single_stack):
    """The official client on 1 worker on the embedded SmolLM2 and the test's Redis
    (tests/integration/conftest.py's ``smollm2_single``, shared with test_openai_stack.py)."""
    with openai.OpenAI(
        base_url=f"{smollm2_single_stack.http}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


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


def test_required_with_parallel_calls_ends_and_keeps_its_calls(oai):
    """With parallel calls allowed, greedy SmolLM2 forced into an array wrote its call again and again
    until max_tokens ("length", the raw array as content). Now ``required`` takes one call alone or
    an array of at most CALLS_PER_TOOL per tool: the answer ends ("tool_calls"), its calls as
    written. The same answer again, cut short inside its last call by max_tokens, keeps the calls
    it completed (finish reason length; its text as content when it completed none)."""
    model = oai.models.list().data[0].id

    def required(max_tokens: int):
        return oai.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
        ).choices[0]

    def called(message) -> list:
        return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]

    whole = required(200)
    tokens = [t.token for t in whole.logprobs.content]
    value, _ = json.JSONDecoder().raw_decode("".join(tokens))  # as written (the stop token after it)
    written = value if isinstance(value, list) else [value]
    assert whole.finish_reason == "tool_calls" and len(written) <= CALLS_PER_TOOL, tokens
    assert called(whole.message) == [(c["name"], c["arguments"]) for c in written]
    cut = required(len(tokens) - 3)  # greedy again: the same tokens, ending before the last call's braces close
    completed = written[:-1] if isinstance(value, list) else []
    assert cut.finish_reason == "length"
    assert called(cut.message) == [(c["name"], c["arguments"]) for c in completed]
    assert (cut.message.content is None) == bool(completed), cut.message


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


def test_echo_logprobs_equal_a_reference_forward(oai, hf_dir):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) against transformers' forward of
    the same GGUF: every prompt token's logprob within 1e-3."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).encode(
        "The capital of France is Paris, and the capital of Italy is Rome."
    )
    model = oai.models.list().data[0].id
    out = oai.completions.create(model=model, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    logprobs = out.choices[0].logprobs
    assert out.usage.completion_tokens == 0 and len(logprobs.token_logprobs) == len(ids)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), dim=-1)
    want = [float(logp[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-3)
    best = [float(logp[p].max()) for p in range(len(ids) - 1)]
    assert [max(top.values()) for top in logprobs.top_logprobs[1:]] == pytest.approx(best, abs=1e-3)


def test_langchain_bind_tools_round_trip(oai):
    """LangChain's ChatOpenAI on lightq: bind_tools, the call, its result as a ToolMessage, the answer."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        return f"21 C and sunny in {city}"

    model = oai.models.list().data[0].id
    llm = ChatOpenAI(
        base_url=str(oai.base_url),
        api_key="unused",
        model=model,
        temperature=0,
        max_tokens=150,
        max_retries=0,
        timeout=120,
    )
    messages = [HumanMessage("What is the weather in Paris?")]
    called = llm.bind_tools([get_weather], tool_choice="any").invoke(messages)  # "any" is OpenAI's required
    assert called.response_metadata["finish_reason"] == "tool_calls" and not called.invalid_tool_calls
    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"city": "Paris"})]
    messages += [called, *(get_weather.invoke(call) for call in called.tool_calls)]
    assert messages[-1].tool_call_id == called.tool_calls[0]["id"]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages, max_tokens=40)
    assert isinstance(final, AIMessage) and final.content and not final.tool_calls


def test_lm_eval_local_completions_equals_its_hf_backend(oai, hf_dir, tmp_path, monkeypatch):
    """lm-eval's multiple-choice task from a local file (tests/integration/lm_eval_task), scored by
    lightq through local-completions (echo + logprobs) and by lm-eval's own hf backend on the same
    weights: the same accuracy, every choice's loglikelihood within 1e-3."""
    pytest.importorskip("lm_eval")
    from tests.integration import lm_eval_runs

    lm_eval_runs.offline(monkeypatch, str(tmp_path / "datasets"))
    served = lm_eval_runs.local_completions(str(oai.base_url), oai.models.list().data[0].id, hf_dir)
    reference = lm_eval_runs.hf(hf_dir)
    assert served.accuracy == reference.accuracy
    assert len(served.loglikelihoods) == 16 and all(len(c) == 4 for c in served.loglikelihoods)
    for got, want in zip(served.loglikelihoods, reference.loglikelihoods):
        assert got == pytest.approx(want, abs=1e-3)
