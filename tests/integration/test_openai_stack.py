"""The official ``openai`` client against real processes (``lightq serve``: producer,
router, one worker on the embedded SmolLM2, the test's Redis): top
log-probabilities from a real model, groups (``n``), and a group cancelled by
its client leaving."""

from __future__ import annotations

import math
import uuid

import pytest

from tests.integration.stack import start_stack

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    log = str(tmp_path_factory.mktemp("openai-stack") / "serve.log")
    stack = start_stack(log, redis_url=redis_url, prefix=f"lightq-oai-{uuid.uuid4().hex[:8]}", workers=1,
                        extra=["--max_total_token_num", "4096", "--max_req_total_len", "1024"])
    yield stack
    assert stack.stop() == 0, open(log).read()[-3000:]


@pytest.fixture(scope="module")
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
    out = oai.chat.completions.create(model=model_id(oai), messages=MESSAGES, max_tokens=6, temperature=0,
                                      logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert (first.token, first.logprob) == (entry.token, entry.logprob) and first.logprob >= second.logprob
        assert first.bytes == list(first.token.encode())
