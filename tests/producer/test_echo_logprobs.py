"""``echo`` + ``logprobs`` and ``max_tokens: 0`` in /v1/completions through the official client (what
lm-eval's local-completions sends for loglikelihood): the ask reaches the worker as
``SamplingParams.prompt_logprobs``; the prompt's logprobs (sent with the first token, here by a hand-
driven fake worker) lead the choice's logprobs, the first token's null; score-only leaves the one
generated token out."""

from __future__ import annotations

import asyncio
import json

import pytest

from shared.chunk_schemas import TokenChunk

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is Paris"


async def answer_with_prompt_logprobs(worker, texts: list[str]):
    """Take one request and answer it: its first chunk carries made-up prompt logprobs
    (-0.5 - p for prompt token p + 1, alternatives: that token, then id 200 at -9)."""
    request = await worker.take()
    prompt = request.prompt_ids
    scored = [(-0.5 - p, [(prompt[p + 1], -0.5 - p), (200, -9.0)]) for p in range(len(prompt) - 1)]
    for choice in range(request.n):  # a group: its leader (choice 0) carries them
        for index, text in enumerate(texts):
            last = index == len(texts) - 1
            await worker.append(
                TokenChunk(
                    request_id=request.id,
                    index=index,
                    choice=choice,
                    token_id=300 + index,
                    text=text,
                    logprob=-0.25,
                    prompt_logprobs=scored if index == choice == 0 else None,
                    finished=last,
                    finish_reason="length" if last else None,
                )
            )
    return request


async def test_score_only_echo_gives_the_prompts_logprobs(oai, worker, tokenizer):
    answering = asyncio.create_task(answer_with_prompt_logprobs(worker, ["X"]))
    out = await oai.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    request = await answering
    assert request.params.prompt_logprobs == 1 and request.params.max_new_tokens == 1
    ids = tokenizer.encode(PROMPT)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    logprobs = choice.logprobs
    texts = [tokenizer.decode([i]) for i in ids]
    assert logprobs.tokens == texts and "".join(texts) == PROMPT
    assert logprobs.token_logprobs == [None, *(-0.5 - p for p in range(len(ids) - 1))]
    assert logprobs.top_logprobs[0] is None
    assert logprobs.top_logprobs[1] == {texts[1]: -0.5, tokenizer.decode([200]): -9.0}
    assert logprobs.text_offset == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]


async def test_echo_logprobs_then_the_generated_tokens(oai, worker, tokenizer):
    answering = asyncio.create_task(answer_with_prompt_logprobs(worker, [" It", " is"]))
    out = await oai.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=2)
    await answering
    n = len(tokenizer.encode(PROMPT))
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == PROMPT + " It is" and out.usage.completion_tokens == 2
    assert len(logprobs.tokens) == n + 2 and logprobs.token_logprobs[n:] == [-0.25, -0.25]
    assert logprobs.text_offset[n:] == [len(PROMPT), len(PROMPT) + 3]


async def test_every_sample_of_a_group_echoes_the_prompts_logprobs(oai, worker, tokenizer):
    answering = asyncio.create_task(answer_with_prompt_logprobs(worker, ["X"]))
    out = await oai.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, n=2)
    await answering
    n = len(tokenizer.encode(PROMPT))
    assert [len(c.logprobs.tokens) for c in out.choices] == [n, n]
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs
    assert out.usage.completion_tokens == 0


@pytest.mark.parametrize("extra", [dict(max_tokens=0), dict(echo=True, logprobs=1)])
async def test_not_streamed(client, aredis, keys, extra):
    body = {"model": MODEL, "prompt": PROMPT, "stream": True, **extra}
    response = await client.post("/v1/completions", content=json.dumps(body))
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream"
    assert await aredis.xlen(keys.requests()) == 0


async def test_generate_returns_the_prompts_logprobs(client, worker, tokenizer):
    answering = asyncio.create_task(answer_with_prompt_logprobs(worker, ["X"]))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 1, "prompt_logprobs": 1}}
    response = await client.post("/generate", content=json.dumps(body))
    request = await answering
    assert response.status_code == 200, response.text
    assert request.params.prompt_logprobs == 1
    ids = tokenizer.encode(PROMPT)
    details = response.json()["prompt_logprobs"]
    assert [d["id"] for d in details] == ids and details[0]["logprob"] is None
    assert [d["logprob"] for d in details[1:]] == [-0.5 - p for p in range(len(ids) - 1)]
    assert details[1]["top_logprobs"] == [[ids[1], -0.5], [200, -9.0]]


async def test_generate_stream_sends_the_prompts_logprobs_with_its_first_event(client, worker, tokenizer):
    """They were computed on the worker and dropped on the stream (red team 3)."""
    answering = asyncio.create_task(answer_with_prompt_logprobs(worker, ["X", "Y"]))
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "prompt_logprobs": 1}}
    response = await client.post("/generate_stream", content=json.dumps(body))
    await answering
    assert response.status_code == 200, response.text
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    assert [e["token"]["text"] for e in events] == ["X", "Y"]
    ids = tokenizer.encode(PROMPT)
    details = events[0]["prompt_logprobs"]
    assert [d["id"] for d in details] == ids and details[0]["logprob"] is None
    assert [d["logprob"] for d in details[1:]] == [-0.5 - p for p in range(len(ids) - 1)]
    assert "prompt_logprobs" not in events[1]  # once
