"""Groups (n / best_of samples of one prompt) at the producer, fed by the fake
worker (which interleaves the choices, highest first): one ingress entry with
``n``, answers demultiplexed by ``choice``, usage counting the prompt once."""

from __future__ import annotations

import asyncio

import pytest

from producer.streams.streaming import ChunkFollower
from shared.chunk_schemas import TokenChunk
from shared.keys import Keys

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "Capital of France?"}]


def hello(request):
    return ["Paris", " is", " nice"], "length"


async def test_generate_best_of_answers_a_text_per_sample(client, worker):
    body = {"inputs": "hi", "parameters": {"best_of": 3, "n": 3, "do_sample": True, "return_details": True}}
    task = asyncio.create_task(client.post("/generate", json=body))
    request = await worker.take()
    assert request.n == 3 and request.params.seed is not None  # a sampled group gets a seed (exact restarts)
    await worker.generate(request, ["Hel", "lo"], finish_reason="stop")
    answer = (await task).json()
    assert answer["generated_text"] == ["Hello", "Hel1lo1", "Hel2lo2"]
    assert answer["count_output_tokens"] == [2, 2, 2] and answer["finish_reason"] == ["stop"] * 3
    assert [[t["text"] for t in sample] for sample in answer["tokens"]] == [
        ["Hel", "lo"],
        ["Hel1", "lo1"],
        ["Hel2", "lo2"],
    ]


async def test_openai_completion_n3_whole_and_streamed(oai, worker):
    async with worker.answering(hello) as seen:
        out = await oai.completions.create(
            model=MODEL, prompt="The capital of France is", n=3, best_of=3, max_tokens=5, temperature=0
        )
        stream = await oai.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            n=3,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert [r.n for r in seen] == [3, 3] and seen[0].params.seed is None  # greedy needs no seed
    assert [(c.index, c.text) for c in out.choices] == [
        (0, "Paris is nice"),
        (1, "Paris1 is1 nice1"),
        (2, "Paris2 is2 nice2"),
    ]
    n_prompt = len(seen[0].prompt_ids)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (n_prompt, 9, n_prompt + 9)
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert texts == {0: "Paris is nice", 1: "Paris1 is1 nice1", 2: "Paris2 is2 nice2"}
    ends = [
        (c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert sorted(ends) == [(0, "length"), (1, "length"), (2, "length")]
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == n_prompt


async def test_openai_chat_n3_whole_and_streamed(oai, worker):
    async with worker.answering(hello):
        out = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=5)
        stream = await oai.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=5, stream=True)
        chunks = [chunk async for chunk in stream]
    assert [c.message.content for c in out.choices] == ["Paris is nice", "Paris1 is1 nice1", "Paris2 is2 nice2"]
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 9
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert roles == [0, 1, 2]
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i) for i in range(3)}
    assert texts == {0: "Paris is nice", 1: "Paris1 is1 nice1", 2: "Paris2 is2 nice2"}


async def test_best_of_above_n_is_a_clear_400(oai):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        await oai.completions.create(model=MODEL, prompt="x", n=2, best_of=4)


def chunk(choice, index, token=True, finished=False, reason=None):
    return TokenChunk(
        request_id="r",
        index=index,
        choice=choice,
        token_id=7 if token else None,
        text=f"{choice}",
        finished=finished,
        finish_reason=reason,
    )


def test_follower_demultiplexes_drops_repeats_per_choice_and_ends_all_on_a_tokenless_chunk():
    reader = ChunkFollower(None, Keys("t"), "r", block_ms=10, n=3)
    assert reader.accept_chunk(chunk(1, 0)) == [chunk(1, 0)]
    assert reader.accept_chunk(chunk(1, 0)) == []  # a repeat of (1, 0)
    assert reader.accept_chunk(chunk(0, 0)) == [chunk(0, 0)]  # (0, 0) is new
    assert reader.accept_chunk(chunk(2, 0, finished=True, reason="length"))[0].finished and not reader.finished
    ends = reader.accept_chunk(chunk(0, 1, token=False, finished=True, reason="cancelled"))
    assert [(c.choice, c.index, c.finish_reason) for c in ends] == [(0, 1, "cancelled"), (1, 1, "cancelled")]
    assert reader.finished and reader.accept_chunk(chunk(1, 1)) == []
