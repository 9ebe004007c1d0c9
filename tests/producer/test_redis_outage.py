"""Redis faults: 503 with Retry-After while Redis is away (never a hang), and back to
normal once it returns; a client following its tokens rides out a short outage."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from producer.app import create_app
from producer.edge.backlog import Gate
from shared.schemas import GenerateRequest, SamplingParams
from tests.waiting import MUST_HAPPEN_S


@pytest.fixture
async def proxied(settings, tokenizer, proxy):
    """A producer app that reaches the test Redis through the proxy."""
    redis = settings.redis.model_copy(update={"url": proxy.url})
    app = create_app(
        settings.model_copy(update={"redis": redis, "redis_timeout_s": 0.5, "redis_outage_s": 5.0}), tokenizer=tokenizer
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://producer", timeout=30
        ) as client:
            yield client


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "redis_unavailable"
    assert response.headers["Retry-After"] == "1"
    assert response.headers["X-Lightq-Reject-Reason"] == "redis_unavailable"


async def test_redis_down_is_a_quick_503_then_reconnects(proxied, proxy):
    body = {"inputs": [1, 2, 3]}
    first = await proxied.post("/v1/requests", json=body)
    assert first.status_code == 202
    await proxy.cut()
    started = time.monotonic()
    assert_unavailable(await proxied.post("/v1/requests", json=body))
    assert_unavailable(await proxied.get(first.json()["status_url"]))
    assert (await proxied.get("/health")).status_code == 503
    assert time.monotonic() - started < 5
    await proxy.start()  # Redis is back: the same client reconnects on its own
    assert (await proxied.post("/v1/requests", json=body)).status_code == 202
    assert (await proxied.get(first.json()["status_url"])).json()["status"] == "queued"


async def test_a_silent_redis_is_a_503_not_a_hang(proxied, proxy):
    await proxy.cut()
    proxy.blackhole = True  # accepts connections, never answers
    await proxy.start()
    started = time.monotonic()
    assert_unavailable(await proxied.post("/generate", json={"inputs": "hi"}))
    assert time.monotonic() - started < 5


async def test_the_gate_bounds_a_request_s_writes_whatever_the_client_s_own_timeouts(proxy, keys):
    """A cluster client reaching no node retries through every seed for many times its timeout (7-14 s with
    a producer's host cut off): the gate's deadline ends the checks and the write together, a 503. The
    client here would wait 60 s: only the deadline can answer within this test's error message."""
    await proxy.cut()
    proxy.blackhole = True
    await proxy.start()
    client = aioredis.from_url(proxy.url, socket_timeout=60, socket_connect_timeout=60)
    gate = Gate(client, keys, max_queue_tokens=1000, require_workers=True, deadline_s=0.3)
    request = GenerateRequest(id="d" * 32, prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=2), created_ms=1)
    try:
        with pytest.raises(RedisError, match=r"did not take the request within 0.3 s"):
            await gate.enqueue(request, ttl_s=60, key_hash=None)
    finally:
        await client.aclose(close_connection_pool=True)


async def blocked_reader(redis_url: str, timeout_s: float = MUST_HAPPEN_S) -> None:
    """Until a client of the real Redis waits in a blocking XREAD (a fixed sleep here once let the
    cut come before the route's first read, on a loaded CI machine)."""
    client = aioredis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while not any(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in await client.client_list()):
            assert time.monotonic() < deadline, "the stream reader never blocked on Redis"
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


async def test_a_stream_rides_out_an_outage(proxied, proxy, worker, redis_url):
    submitted = (await proxied.post("/v1/requests", json={"inputs": "hello"})).json()
    request = await worker.take()
    await worker.token(request.id, 0, "a")
    reading = asyncio.create_task(proxied.get(submitted["stream_url"]))
    await blocked_reader(redis_url)  # the reader has chunk 0 and waits on Redis for the next
    await proxy.cut()
    await worker.token(request.id, 1, "b")  # the worker's Redis is not cut
    await worker.generate(request, ["a", "b", "c"])  # repeats 0 and 1: the reader drops them
    await asyncio.sleep(0.5)
    await proxy.start()
    response = await asyncio.wait_for(reading, 10)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [(c["index"], c["text"]) for c in chunks] == [(0, "a"), (1, "b"), (2, "c")]
    assert chunks[-1]["finished"]
