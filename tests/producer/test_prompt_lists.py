"""``/v1/completions`` with a list of prompts, through the official client and
the fake worker: one request (a group when n > 1) per prompt, choices numbered
prompt * n + sample, usage summing every prompt and completion; every prompt
is checked before any is queued; a client that leaves cancels them all."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from producer.api.errors import ApiError
from producer.app import create_app
from producer.batches.records import BatchLine, prepare_line
from shared import codec
from shared.schemas import GenerateRequest
from tests.redis_keys import keys_with_prefix

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def by_length(request):
    """Texts that tell the prompts apart: its length in tokens, then " ok"."""
    return [f"<{len(request.prompt_ids)}>", " ok"], "length"


def expected_texts(lengths, n):
    return [f"<{length}>{j or ''} ok{j or ''}" for length in lengths for j in range(n)]


async def test_two_text_prompts_with_n2_whole_and_streamed(oai, worker, tokenizer):
    prompts = ["One", "Two words here"]
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert lengths[0] != lengths[1]
    async with worker.answering(by_length) as seen:
        out = await oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=2, temperature=0)
        stream = await oai.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        events = [event async for event in stream]
    assert [(len(r.prompt_ids), r.n) for r in seen] == [(lengths[0], 2), (lengths[1], 2)] * 2
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == expected_texts(lengths, 2)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (sum(lengths), 8)
    streamed = {
        i: "".join(e.choices[0].text for e in events if e.choices and e.choices[0].index == i) for i in range(4)
    }
    assert list(streamed.values()) == expected_texts(lengths, 2)
    ends = sorted(e.choices[0].index for e in events if e.choices and e.choices[0].finish_reason == "length")
    assert ends == [0, 1, 2, 3]
    assert (events[-1].usage.prompt_tokens, events[-1].usage.completion_tokens) == (sum(lengths), 8)


async def test_token_id_prompts_with_echo(oai, worker, tokenizer):
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("Bye")]
    async with worker.answering(by_length) as seen:
        out = await oai.completions.create(model=MODEL, prompt=prompts, echo=True, max_tokens=2)
    assert [r.prompt_ids for r in seen] == prompts
    echoes = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    assert [c.text for c in out.choices] == [e + t for e, t in zip(echoes, expected_texts(map(len, prompts), 1))]


async def test_a_bad_prompt_writes_nothing(client, rclient, redis_settings):
    bad = {"model": MODEL, "prompt": [[1, 2, 3]] * 5 + [[4, 10**6]]}
    response = await client.post("/v1/completions", json=bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt.5"
    many = {"model": MODEL, "prompt": ["hi"] * 65}
    response = await client.post("/v1/completions", json=many)
    assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_prompts"
    assert "64" in response.json()["error"]["message"]
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


async def test_a_batch_line_takes_one_prompt(app):
    services = app.state.services
    line = BatchLine(custom_id="a", method="POST", url="/v1/completions", body={"model": MODEL, "prompt": ["a", "b"]})
    with pytest.raises(ApiError, match="one prompt"):
        await prepare_line(line, services)


async def test_leaving_mid_stream_cancels_every_prompt(server_url, worker):
    body = {"model": MODEL, "prompt": ["first", "second", "third"], "stream": True}
    async with httpx.AsyncClient(base_url=server_url) as client:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            requests = [await worker.take() for _ in range(3)]
            await worker.token(requests[1].id, 0, "Hi")
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
    cancelled = await asyncio.gather(*(worker.wait_cancel(r.id) for r in requests))
    assert cancelled == [True, True, True]


async def test_a_refused_prompt_cancels_the_ones_queued_before_it(settings, tokenizer, aredis, keys):
    """Room for 30 queued tokens: the first prompt (cost 20) goes in, the second does not (429)."""
    app = create_app(settings.model_copy(update={"max_queue_tokens": 30}), tokenizer=tokenizer)
    body = {"model": MODEL, "prompt": [[1] * 10, [2] * 10], "max_tokens": 10}
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            response = await client.post("/v1/completions", json=body)
    assert response.status_code == 429, response.text
    ((_, fields),) = await aredis.xrange(keys.requests())
    queued = codec.from_entry(GenerateRequest, fields)
    assert queued.prompt_ids == [1] * 10 and await aredis.exists(keys.cancel(queued.id))
