"""The official ``openai`` client against real processes (``lightq serve``: producer,
router, one worker on the embedded SmolLM2, the test's Redis): top
log-probabilities from a real model, groups (``n``), a group cancelled by its
client leaving (its KV tokens freed, as the worker's published load shows),
and a list of prompts."""

from __future__ import annotations

import math
import time

import httpx
import pytest

from tests.waiting import MUST_HAPPEN_S

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
def stack(smollm2_single_stack):
    """1 worker on the embedded SmolLM2 and the test's Redis (tests/integration/conftest.py's ``smollm2_single``,
    shared with test_structured_stack.py: its pool of 8,192 tokens, where this module's had 4,096;
    the largest request here, a group of 3 x 900 tokens, fits either)."""
    return smollm2_single_stack


@pytest.fixture
def oai(stack):
    with openai.OpenAI(base_url=f"{stack.http}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def model_id(oai) -> str:
    return oai.models.list().data[0].id


def test_greedy_completion_alternatives_rank_the_chosen_token_first(oai):
    out = oai.completions.create(model=model_id(oai), prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.top_logprobs) == 8
    for token, chosen, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        # Greedy: the chosen token is the most likely, so the dict is the top 3 (fewer only if two
        # ids share a text), led by the chosen token with its own logprob.
        assert 1 <= len(top) <= 3 and token in top and math.isclose(top[token], chosen, abs_tol=1e-6)
        assert chosen == max(top.values()) and all(v <= 0 for v in top.values())
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
    assert "".join(logprobs.tokens) == out.choices[0].text


def test_greedy_chat_top_logprobs_are_sorted_and_start_with_the_chosen_token(oai):
    out = oai.chat.completions.create(
        model=model_id(oai), messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert (first.token, first.logprob) == (entry.token, entry.logprob) and first.logprob >= second.logprob
        assert first.bytes == list(first.token.encode())


def test_greedy_completion_group_gives_three_copies_of_the_single_answer(oai):
    args = dict(model=model_id(oai), prompt=PROMPT, max_tokens=12, temperature=0)
    single = oai.completions.create(**args).choices[0].text
    group = oai.completions.create(**args, n=3)
    assert single.strip() and [c.index for c in group.choices] == [0, 1, 2]
    assert [c.text for c in group.choices] == [single] * 3
    assert group.usage.completion_tokens == 3 * oai.completions.create(**args).usage.completion_tokens
    stream = oai.completions.create(**args, n=3, stream=True)
    texts = ["", "", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [single] * 3


def test_greedy_chat_group_gives_three_copies_of_the_single_answer(oai):
    args = dict(model=model_id(oai), messages=MESSAGES, max_tokens=10, temperature=0)
    single = oai.chat.completions.create(**args).choices[0].message.content
    group = oai.chat.completions.create(**args, n=3)
    assert single and [c.message.content for c in group.choices] == [single] * 3
    assert [c.index for c in group.choices] == [0, 1, 2]


def test_leaving_a_group_mid_stream_frees_the_workers_tokens(oai, stack):
    stream = oai.completions.create(
        model=model_id(oai),
        prompt="Count to a thousand:",
        max_tokens=900,
        n=3,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen: set[int] = set()
    request_id = None
    for chunk in stream:  # until the worker's published load shows the group's tokens
        request_id = chunk.id.removeprefix("cmpl-")
        seen.update(c.index for c in chunk.choices)
        if seen == {0, 1, 2} and any(load.used_tokens for load in stack.live_workers().values()):
            break
    else:
        raise AssertionError("the group finished before its tokens showed in the worker's load")
    stream.close()  # the client leaves: the producer cancels the group
    status = wait_for(
        lambda: httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json(),
        lambda s: s["status"] == "cancelled",
    )
    assert status["output_tokens"] < 3 * 900
    wait_for(lambda: [load.used_tokens for load in stack.live_workers().values()], lambda used: not any(used))


def wait_for(read, done, timeout_s=MUST_HAPPEN_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = read()
        if done(value):
            return value
        time.sleep(0.2)
    raise AssertionError(f"still {value} after {timeout_s} s")


def test_a_list_of_prompts_answers_each_prompt_n_times_in_order(oai):
    args = dict(model=model_id(oai), max_tokens=8, temperature=0)
    prompts = [PROMPT, "Water is made of"]
    singles = [oai.completions.create(**args, prompt=p).choices[0].text for p in prompts]
    out = oai.completions.create(**args, prompt=prompts, n=2)
    assert singles[0] != singles[1]
    assert [c.text for c in out.choices] == [singles[0], singles[0], singles[1], singles[1]]
