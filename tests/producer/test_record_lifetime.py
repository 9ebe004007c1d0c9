"""A request's records live as long as the request (issue 14, items 7 and 11).

No record of a live request has a TTL, however short ``--redis_request_ttl_s``
is: the TTL starts when the request ends (``shared.request_log.end_request``, the worker's end).
A status hash without its ``status`` field (what an expiry or an empty Redis
leaves once a late writer touched it) is an unknown request, a 404, and an
open stream ends with a clear final error event.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from producer import store
from producer.api import routes_requests
from shared.config import RedisSettings
from shared.producer_settings import ProducerSettings
from shared.request_log import end_request
from shared.requeue import requeue
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams

BODY = {"inputs": "Tell me about Redis streams.", "parameters": {"max_new_tokens": 8}}
SHORT_TTL_S = 1


@pytest.fixture
def settings(redis_settings) -> ProducerSettings:
    short = RedisSettings(url=redis_settings.url, key_prefix=redis_settings.key_prefix, request_ttl_s=SHORT_TTL_S)
    return ProducerSettings(redis=short, default_max_new_tokens=16, stream_block_ms=100)


async def submit(client) -> str:
    response = await client.post("/v1/requests", json=BODY)
    assert response.status_code == 202
    return response.json()["id"]


async def test_live_records_have_no_ttl_until_the_end(client, worker, aredis, keys, rclient, monkeypatch):
    monkeypatch.setattr(routes_requests, "CANCEL_WAIT_S", 0.2)  # nobody ends it here: do not wait long
    request_id = await submit(client)
    assert await aredis.ttl(keys.meta(request_id)) == -1  # queued
    request = await worker.take()
    await worker.token(request.id, 0, "Hi")
    assert (await client.delete(f"/v1/requests/{request_id}")).status_code == 202
    for key in keys.all_request_keys(request_id):
        assert await aredis.ttl(key) == -1, key  # running, cancel asked: nothing may expire yet
    assert end_request(
        rclient, keys, request_id, status=RequestStatus.CANCELLED, reason="cancelled", num_output=1, ttl_s=SHORT_TTL_S
    )
    for key in keys.all_request_keys(request_id):
        assert 0 < await aredis.ttl(key) <= SHORT_TTL_S, key


async def test_cancelling_an_ended_request_leaves_no_key_without_ttl(client, worker, aredis, keys):
    request_id = await submit(client)
    await worker.generate(await worker.take(), ["done"], finish_reason="stop")
    await store.request_cancel(aredis, keys, request_id, SHORT_TTL_S)  # a late cancel, e.g. a client leaving
    assert 0 < await aredis.ttl(keys.cancel(request_id)) <= SHORT_TTL_S
    await store.request_cancel(aredis, keys, "0" * 32, SHORT_TTL_S)  # no record at all
    assert 0 < await aredis.ttl(keys.cancel("0" * 32)) <= SHORT_TTL_S


async def test_a_record_without_status_is_a_404(client, worker, aredis, keys):
    request_id = await submit(client)
    await worker.take()
    await aredis.delete(keys.meta(request_id))
    await aredis.hset(keys.meta(request_id), "output_tokens", 3)  # a late writer after the record went
    response = await client.get(f"/v1/requests/{request_id}")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert (await client.get(f"/v1/requests/{request_id}/stream")).status_code == 404
    assert (await client.delete(f"/v1/requests/{request_id}")).status_code == 404


async def test_an_open_stream_ends_with_an_error_event_when_the_record_loses_its_status(client, worker, aredis, keys):
    request_id = await submit(client)
    request = await worker.take()
    await worker.token(request.id, 0, "Hi")

    async def lose_record():
        await asyncio.sleep(0.3)  # the stream below is open and has read the first chunk
        await aredis.delete(keys.meta(request_id))
        await aredis.hset(keys.meta(request_id), "worker", "late-writer")

    task = asyncio.create_task(lose_record())
    response = await client.get(f"/v1/requests/{request_id}/stream")
    await task
    assert response.status_code == 200
    events = [
        json.loads(line.removeprefix("data: ")) for line in response.text.splitlines() if line.startswith("data: ")
    ]
    assert [e["text"] for e in events] == ["Hi", ""]
    last = events[-1]
    assert last["finished"] and last["finish_reason"] == "error" and "record" in last["error"]


def test_requeue_ends_a_request_whose_record_lost_its_status(rclient, keys):
    request = GenerateRequest(id="lost", prompt_ids=[1, 2], params=SamplingParams(), created_ms=0)
    rclient.hset(keys.meta("lost"), "worker", "w1")  # the router's dispatch wrote into an emptied Redis
    assert requeue(rclient, keys, request, ttl_s=60, max_attempts=3) == 0
    meta = RequestMeta.from_hash(rclient.hgetall(keys.meta("lost")))
    assert meta.status is RequestStatus.FAILED and "lost" in meta.error
    assert all(0 < rclient.ttl(key) <= 60 for key in keys.all_request_keys("lost") if rclient.exists(key))
    assert rclient.xrange(keys.requests()) == []  # not sent round again
