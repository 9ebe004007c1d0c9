"""A request no live worker could ever hold (``producer.edge.pool_fit``) is a 400
``request_too_large`` at the door, on every route, before anything is written; one that fits a
worker, or arrives while no worker's record is there, is queued as before."""

from __future__ import annotations

import asyncio

from producer.api.openai_types import ChatCompletionRequest
from producer.api.routes_openai import prepare_chat
from producer.batches.job import job_services
from producer.edge.pool_fit import REFRESH_S
from shared.keys import Keys
from tests.router.helpers import publish_load

MODEL = "SmolLM2-135M-Instruct.Q4_1"


async def keys_now(aredis) -> set[bytes]:
    return {k async for k in aredis.scan_iter(match="*")}


async def test_a_group_over_every_pool_is_refused_at_the_door(client, aredis, keys: Keys, rclient):
    publish_load(rclient, keys, "w1", max_total=1000)
    publish_load(rclient, keys, "w2", max_total=1500)
    before = await keys_now(aredis)
    body = {"inputs": [1] * 10, "parameters": {"max_new_tokens": 200, "n": 8, "best_of": 8}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large", error
    assert "1610 KV tokens" in error["message"] and "1500" in error["message"], error["message"]
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1400, "n": 2}
    response = await client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large", response.text
    assert await keys_now(aredis) == before  # nothing written: no status hash, no ingress entry


async def test_more_samples_than_any_worker_runs_is_refused(client, keys: Keys, rclient):
    publish_load(rclient, keys, "w1", max_total=100_000, running_max=4)
    body = {"inputs": [1] * 10, "parameters": {"max_new_tokens": 4, "n": 6, "best_of": 6, "do_sample": True}}
    response = await client.post("/generate", json=body)
    assert response.status_code == 400 and "at most 4 requests" in response.json()["error"]["message"]


async def test_what_fits_one_worker_or_comes_before_any_is_queued(client, aredis, keys: Keys, rclient):
    body = {"inputs": [1] * 10, "parameters": {"max_new_tokens": 1500}}  # 1,510 KV tokens at most
    assert (await client.post("/v1/requests", json=body)).status_code == 202  # no worker yet: the router decides
    publish_load(rclient, keys, "small", max_total=1000)
    await asyncio.sleep(REFRESH_S + 0.1)  # the records are read at most every REFRESH_S
    assert (await client.post("/v1/requests", json=body)).status_code == 400
    publish_load(rclient, keys, "large", max_total=2000)
    await asyncio.sleep(REFRESH_S + 0.1)
    assert (await client.post("/v1/requests", json=body)).status_code == 202  # fits "large"
    assert await aredis.xlen(keys.requests()) == 2


async def test_chat_without_max_tokens_shares_the_largest_pool_among_its_answers(app, keys: Keys, rclient):
    """Without ``max_tokens`` a chat answer may fill the context; ``n`` of them share the largest live
    pool, so the request fits it (it was a request no worker could take)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 4}
    alone, _ = await prepare_chat(ChatCompletionRequest.model_validate({**body, "n": 1}), app.state.services)
    assert alone.params.max_new_tokens == 2048 - len(alone.prompt_ids)  # no worker known: the context
    publish_load(rclient, keys, "small", max_total=500)
    publish_load(rclient, keys, "large", max_total=1000)
    await asyncio.sleep(REFRESH_S + 0.1)
    request, _ = await prepare_chat(ChatCompletionRequest.model_validate(body), app.state.services)
    prompt = len(request.prompt_ids)
    assert request.params.max_new_tokens == (1000 - prompt) // 4 and request.max_tokens_needed <= 1000
    given, _ = await prepare_chat(ChatCompletionRequest.model_validate({**body, "max_tokens": 300}), app.state.services)
    assert given.params.max_new_tokens == 300  # asked for: kept (and refused at the door if it fits nowhere)


async def test_a_batch_chat_line_without_max_tokens_shares_the_pool_as_the_route_does(
    settings, tokenizer, keys: Keys, rclient
):
    """A batch job prepares its lines with the live pools' sizes too: a chat line with ``n`` and no
    ``max_tokens`` fits the largest pool (it was accepted at upload, then failed request_too_large)."""
    services = job_services(settings, tokenizer)
    try:
        publish_load(rclient, keys, "w1", max_total=1000)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 4}
        request, _ = await prepare_chat(ChatCompletionRequest.model_validate(body), services)
        assert request.params.max_new_tokens == (1000 - len(request.prompt_ids)) // 4
    finally:
        await services.redis.aclose()


async def test_what_admission_keeps_free_is_not_offered_at_the_door(client, app, aredis, keys: Keys, rclient):
    """A worker's record says what admission lets one request need there (its pool less the policy's
    margin). A request between that and the pool passed the door and then failed in the router (or
    ran, as the output-length history had it); a chat without max_tokens and n=4 always landed
    there (red team 3). Now the first is a 400 at the door and the second shares the limit."""
    publish_load(rclient, keys, "w1", max_total=1000, admission_limit=950)
    before = await keys_now(aredis)
    body = {"inputs": [1] * 10, "parameters": {"max_new_tokens": 960}}  # 970 KV tokens: within the pool
    response = await client.post("/generate", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_large", response.text
    assert "less the share admission keeps free (950)" in response.json()["error"]["message"]
    assert await keys_now(aredis) == before
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 4}
    request, _ = await prepare_chat(ChatCompletionRequest.model_validate(chat), app.state.services)
    assert request.params.max_new_tokens == (950 - len(request.prompt_ids)) // 4
