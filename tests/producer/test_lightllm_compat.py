"""LightLLM's spellings (issue 14, item 9): greedy as ``temperature: 0`` / ``top_k: 0``,
the ``special`` flag of stream events, ``--max_req_input_len``."""

from __future__ import annotations

import asyncio
import json

import pytest

from shared.config import ModelSettings
from shared.producer_settings import ProducerSettings

GREEDY = [
    {"temperature": 0, "top_k": 0, "do_sample": False},
    {"temperature": 0.0},
    {"top_k": 0},
    {"temperature": 0, "do_sample": True},
]


async def accepted(client, worker, parameters):
    task = asyncio.create_task(client.post("/generate", json={"inputs": "hello", "parameters": parameters}))
    request = await worker.take()
    await worker.generate(request, ["x"], finish_reason="stop")
    assert (await task).status_code == 200
    return request.params


@pytest.mark.parametrize("parameters", GREEDY)
async def test_lightllm_greedy_spellings_are_greedy(client, worker, parameters):
    params = await accepted(client, worker, parameters)
    assert params.is_greedy and not params.do_sample
    assert params.temperature > 0 and params.top_k == -1  # what the worker's sampler takes as "no limit"


async def test_top_k_zero_with_sampling_means_no_top_k(client, worker):
    params = await accepted(client, worker, {"do_sample": True, "temperature": 0.7, "top_k": 0})
    assert params.do_sample and params.temperature == 0.7 and params.top_k == -1


async def test_stream_events_flag_special_tokens(client, worker, tokenizer):
    task = asyncio.create_task(client.post("/generate_stream", json={"inputs": "hello"}))
    request = await worker.take()
    await worker.token(request.id, 0, " Hi", token_id=tokenizer.encode(" Hi")[0])
    await worker.token(request.id, 1, "", token_id=tokenizer.eos_token_id, finish_reason="stop")
    body = (await task).text
    tokens = [json.loads(block.removeprefix("data:"))["token"] for block in body.split("\n\n") if block]
    assert [(t["text"], t["special"]) for t in tokens] == [(" Hi", False), ("", True)]
    assert tokenizer.eos_token_id in tokenizer.all_special_ids


@pytest.fixture
def settings(redis_settings) -> ProducerSettings:
    return ProducerSettings(
        redis=redis_settings, model=ModelSettings(max_req_total_len=2048, max_req_input_len=4), stream_block_ms=100
    )


@pytest.mark.parametrize(
    "route, body",
    [
        ("/generate", {"inputs": "one two three four five six seven"}),
        ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "one two three four five six seven"}),
        (
            "/v1/chat/completions",
            {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "one two three"}]},
        ),
    ],
)
async def test_max_req_input_len_bounds_the_prompt(client, rclient, redis_settings, route, body):
    response = await client.post(route, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "max_req_input_len 4" in error["message"]
    assert list(rclient.scan_iter(match=f"{redis_settings.key_prefix}:*")) == []
