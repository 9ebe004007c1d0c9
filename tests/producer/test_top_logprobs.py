"""Top log-probabilities through the official client, fed by the fake worker
(whose chunks carry ``fake_top``: the chosen token first, then id + 1, + 2...):
the ask reaches the worker as ``SamplingParams.top_logprobs``, each id is
rendered as its own text, completions add the chosen token to the dict."""

from __future__ import annotations

import pytest

from producer.api.openai_render import Call, response
from producer.api.vocabulary import Vocabulary
from shared.chunk_schemas import TokenChunk
from tests.producer.fake_worker import fake_top

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "Capital of France?"}]


def hello(request):
    return ["Paris", " is", " nice"], "length"


def completion_top(tokenizer, token_id, k):
    return {tokenizer.decode([i]): lp for i, lp in fake_top(token_id, k)}


async def test_completion_logprobs_3_whole_and_streamed(oai, worker, tokenizer):
    async with worker.answering(hello) as seen:
        out = await oai.completions.create(model=MODEL, prompt="The capital", logprobs=3, max_tokens=3)
        stream = await oai.completions.create(model=MODEL, prompt="The capital", logprobs=3, max_tokens=3, stream=True)
        events = [event async for event in stream]
        plain = await oai.completions.create(model=MODEL, prompt="The capital", logprobs=0, max_tokens=3)
    assert [r.params.top_logprobs for r in seen] == [3, 3, 0]
    want = [completion_top(tokenizer, 100 + i, 3) for i in range(3)]
    assert all(len(top) == 3 for top in want)  # ids 100..104 decode to distinct texts
    logprobs = out.choices[0].logprobs
    assert logprobs.top_logprobs == want and logprobs.token_logprobs == [-0.25] * 3
    assert logprobs.tokens == [tokenizer.decode([100 + i]) for i in range(3)]
    assert [e.choices[0].logprobs.top_logprobs for e in events] == [[top] for top in want]
    assert plain.choices[0].logprobs.top_logprobs == [{tokenizer.decode([100 + i]): -0.25} for i in range(3)]


async def test_chat_top_logprobs_2_whole_and_streamed(oai, worker, tokenizer):
    async with worker.answering(hello) as seen:
        out = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=3
        )
        stream = await oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, max_tokens=3, stream=True
        )
        events = [event async for event in stream]
        plain = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, max_tokens=3)
    assert [r.params.top_logprobs for r in seen] == [2, 2, 0]

    def expected(i):
        return [(tokenizer.decode([t]), lp, list(tokenizer.decode([t]).encode())) for t, lp in fake_top(100 + i, 2)]

    content = out.choices[0].logprobs.content
    assert [[(t.token, t.logprob, t.bytes) for t in c.top_logprobs] for c in content] == [expected(i) for i in range(3)]
    assert [c.token for c in content] == [tokenizer.decode([100 + i]) for i in range(3)]
    streamed = [e.choices[0].logprobs.content for e in events if e.choices and e.choices[0].logprobs]
    assert [[(t.token, t.logprob) for t in c[0].top_logprobs] for c in streamed] == [
        [(tok, lp) for tok, lp, _ in expected(i)] for i in range(3)
    ]
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)


async def test_group_chunks_keep_their_own_alternatives(oai, worker, tokenizer):
    async with worker.answering(hello):
        out = await oai.completions.create(
            model=MODEL, prompt="The capital", logprobs=2, n=2, max_tokens=3, temperature=0
        )
    assert [c.logprobs.top_logprobs for c in out.choices] == [
        [completion_top(tokenizer, 100 + i, 2) for i in range(3)]
    ] * 2


def test_a_sampled_token_outside_the_alternatives_joins_the_completion_dict(tokenizer):
    """OpenAI: up to logprobs + 1 entries, the chosen token always among them; chat lists only the top k."""
    chunk = TokenChunk(
        request_id="r", index=0, token_id=300, text="x", logprob=-4.0, top_logprobs=[(100, -0.5), (101, -1.0)]
    )
    call = Call("completion", "cmpl-r", 0, MODEL, 3, logprobs=True)
    vocab = Vocabulary(tokenizer)
    top = (
        response(call, [chunk.model_copy(update={"finished": True, "finish_reason": "length"})], vocab)
        .choices[0]
        .logprobs.top_logprobs
    )
    assert top == [{tokenizer.decode([100]): -0.5, tokenizer.decode([101]): -1.0, tokenizer.decode([300]): -4.0}]
    chat = response(
        Call("chat", "chatcmpl-r", 0, MODEL, 3, logprobs=True),
        [chunk.model_copy(update={"finished": True, "finish_reason": "length"})],
        vocab,
    )
    entry = chat.choices[0].logprobs.content[0]
    assert (entry.token, entry.logprob) == (tokenizer.decode([300]), -4.0)
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
        (tokenizer.decode([100]), -0.5),
        (tokenizer.decode([101]), -1.0),
    ]


def test_chat_logprobs_bytes_are_each_tokens_own(tokenizer):
    """An emoji is three byte-level tokens here, each decoding alone to U+FFFD: their bytes (OpenAI's
    field for this) must be the tokens' own, so that a client rebuilds the emoji (they were the
    replacement character's, EF BF BD, for each: red team 3)."""
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and all(tokenizer.decode([i]) == "\ufffd" for i in ids)
    chunks = [
        TokenChunk(request_id="r", index=k, token_id=i, text="", logprob=-0.1, top_logprobs=[(i, -0.1)])
        for k, i in enumerate(ids)
    ]
    chunks[-1] = chunks[-1].model_copy(update={"text": "😀", "finished": True, "finish_reason": "length"})
    chat = response(Call("chat", "chatcmpl-r", 0, MODEL, len(ids), logprobs=True), chunks, Vocabulary(tokenizer))
    content = chat.choices[0].logprobs.content
    assert b"".join(bytes(entry.bytes) for entry in content).decode() == "😀"
    assert [entry.top_logprobs[0].bytes for entry in content] == [entry.bytes for entry in content]
    assert Vocabulary(tokenizer).raw(tokenizer.encode(" hello")[0]) == list(b" hello")


def test_the_vocabularys_bytes_built_on_a_thread_are_the_same(tokenizer):
    """``Vocabulary.prepare`` (a chat asking for logprobs, before its chunks render: the build and
    its xgrammar import off the event loop) gives what ``raw`` builds in place."""
    import asyncio

    ids = tokenizer.encode("😀 hello")
    prepared = Vocabulary(tokenizer)
    asyncio.run(prepared.prepare())
    assert prepared._bytes is not None
    assert [prepared.raw(i) for i in ids] == [Vocabulary(tokenizer).raw(i) for i in ids]
