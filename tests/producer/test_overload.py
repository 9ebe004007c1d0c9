"""Overload: the bounded backlog (--max_queue_tokens), the no-worker check, and deadlines."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from producer.app import create_app
from producer.edge.backlog import MAX_RETRY_AFTER_S, DrainRate
from shared import codec
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group_async
from shared.schemas import GenerateRequest, RequestStatus

REQUEST = {"inputs": [1] * 10, "parameters": {"max_new_tokens": 10}}  # costs 20 with no history


@pytest.fixture
async def limited(settings, tokenizer):
    """A producer with room for 100 queued tokens that refuses requests while no worker is live."""
    app = create_app(settings.model_copy(update={"max_queue_tokens": 100}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            yield client


def assert_queue_full(response: httpx.Response) -> None:
    assert response.status_code == 429, response.text
    assert response.json()["error"]["code"] == "queue_full"
    assert response.headers["X-Lightq-Reject-Reason"] == "queue_full"
    assert 1 <= int(response.headers["Retry-After"]) <= MAX_RETRY_AFTER_S


async def test_backlog_limit_counts_tokens_until_dispatch(limited, aredis, keys):
    for _ in range(5):
        assert (await limited.post("/v1/requests", json=REQUEST)).status_code == 202
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))
    assert_queue_full(await limited.post("/generate", json=REQUEST))
    assert await aredis.xlen(keys.requests()) == 5  # nothing written for the refused ones
    # Read by a router but not yet dispatched: still queued.
    await ensure_group_async(aredis, keys.requests(), ROUTER_GROUP)
    await aredis.xreadgroup(ROUTER_GROUP, "router-1", {keys.requests(): ">"}, count=2)
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))
    ((first_id, _),) = await aredis.xrange(keys.requests(), count=1)
    await aredis.xack(keys.requests(), ROUTER_GROUP, first_id)  # dispatched: its 20 tokens leave the queue
    assert (await limited.post("/v1/requests", json=REQUEST)).status_code == 202
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))
    text = (await limited.get("/metrics")).text
    assert 'lightq:requests_rejected_total{reason="queue_full"} 4.0' in text


async def test_the_backlog_counts_every_class(limited, aredis, keys):
    """Each class has its stream (shared.ingress); the limit is on them all: the oldest unfinished
    entry of any class bounds what is queued."""
    worse = {**REQUEST, "parameters": {**REQUEST["parameters"], "priority": 3}}
    for body in (worse, worse, REQUEST, REQUEST, worse):
        assert (await limited.post("/v1/requests", json=body)).status_code == 202
    assert (await aredis.xlen(keys.requests(3)), await aredis.xlen(keys.requests())) == (3, 2)
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))
    for stream in (keys.requests(), keys.requests(3)):  # every entry dispatched: the queue is empty
        await ensure_group_async(aredis, stream, ROUTER_GROUP)
        await aredis.xreadgroup(ROUTER_GROUP, "router-1", {stream: ">"}, count=10)
        for entry_id, _ in await aredis.xrange(stream):
            await aredis.xack(stream, ROUTER_GROUP, entry_id)
    for _ in range(5):
        assert (await limited.post("/v1/requests", json=worse)).status_code == 202


async def test_cost_uses_the_output_history(limited, aredis, keys):
    await aredis.lpush(keys.output_lengths(), 2, 4, 6)  # mean 4
    costs = []
    for parameters in ({"max_new_tokens": 10}, {"max_new_tokens": 10, "ignore_eos": True}, {"max_new_tokens": 2}):
        before = int(await aredis.get(keys.enqueued_tokens()) or 0)
        assert (
            await limited.post("/v1/requests", json={"inputs": [1] * 10, "parameters": parameters})
        ).status_code == 202
        costs.append(int(await aredis.get(keys.enqueued_tokens())) - before)
    assert costs == [10 + 4, 10 + 10, 10 + 2]  # the mean; max_new_tokens with ignore_eos; capped by it


async def test_an_empty_queue_takes_a_request_larger_than_the_limit(limited):
    big = {"inputs": [1] * 200, "parameters": {"max_new_tokens": 10}}
    assert (await limited.post("/v1/requests", json=big)).status_code == 202
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))


async def test_requeued_entries_without_a_count_are_skipped(limited, worker, aredis, keys):
    assert (await limited.post("/v1/requests", json=REQUEST)).status_code == 202
    await worker.take()
    stray = GenerateRequest(id="f" * 32, prompt_ids=[1], params={"max_new_tokens": 1}, created_ms=1)
    await aredis.xadd(keys.requests(), codec.entry(stray))  # as a router re-queues a dead worker's request
    for _ in range(5):
        assert (await limited.post("/v1/requests", json=REQUEST)).status_code == 202
    assert_queue_full(await limited.post("/v1/requests", json=REQUEST))


async def test_concurrent_producers_never_overshoot(settings, tokenizer, aredis, keys):
    apps = [create_app(settings.model_copy(update={"max_queue_tokens": 100}), tokenizer=tokenizer) for _ in range(3)]
    async with (
        apps[0].router.lifespan_context(apps[0]),
        apps[1].router.lifespan_context(apps[1]),
        apps[2].router.lifespan_context(apps[2]),
    ):
        clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p") for app in apps]
        responses = await asyncio.gather(*(clients[n % 3].post("/v1/requests", json=REQUEST) for n in range(30)))
        for client in clients:
            await client.aclose()
    assert sorted(r.status_code for r in responses) == [202] * 5 + [429] * 25
    assert await aredis.xlen(keys.requests()) == 5


def test_retry_after_follows_the_drain_rate():
    drain = DrainRate()
    assert drain.retry_after(500) == 1.0  # nothing measured yet: come back soon
    for second in range(11):
        drain.observe(100.0 + second, 50 * second)  # 50 tokens/s leave the queue
    assert drain.retry_after(500) == pytest.approx(10.0)
    assert drain.retry_after(10) == 1.0  # never below a second
    assert drain.retry_after(10**6) == MAX_RETRY_AFTER_S
    stalled = DrainRate()
    for second in range(6):
        stalled.observe(100.0 + second, 0)  # nothing left the queue for 5 s
    assert stalled.retry_after(10) == pytest.approx(5.0)
    drain.observe(200.0, 0)  # the counter restarted: old samples are dropped
    assert drain.retry_after(500) == 1.0


async def test_no_workers_is_503_when_asked_for(settings, tokenizer, aredis, keys, rclient, redis_settings):
    app = create_app(settings.model_copy(update={"reject_without_workers": True}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://p") as client:
            response = await client.post("/v1/requests", json=REQUEST)
            assert response.status_code == 503 and response.json()["error"]["code"] == "no_workers"
            assert response.headers["X-Lightq-Reject-Reason"] == "no_workers" and response.headers["Retry-After"]
            assert not await aredis.exists(keys.requests())
            await aredis.zadd(keys.workers(), {"w1": 1})
            await aredis.set(keys.load("w1"), "{}", ex=60)  # a heartbeat
            await asyncio.sleep(0.6)  # the live-worker answer is cached for half a second
            assert (await client.post("/v1/requests", json=REQUEST)).status_code == 202


async def queued_request(aredis, keys) -> GenerateRequest:
    ((_, fields),) = await aredis.xrange(keys.requests())
    return codec.from_entry(GenerateRequest, fields)


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/requests", {"inputs": "hi", "parameters": {"timeout": 2.5}}),
        ("/v1/completions", {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "hi", "timeout": 2.5}),
    ],
)
async def test_timeout_becomes_a_deadline(client, aredis, keys, route, body):
    task = asyncio.create_task(client.post(route, json=body))
    while not await aredis.exists(keys.requests()):
        await asyncio.sleep(0.01)
    request = await queued_request(aredis, keys)
    assert request.deadline_ms == request.created_ms + 2500
    task.cancel()


async def test_no_timeout_no_deadline(client, aredis, keys):
    assert (await client.post("/v1/requests", json={"inputs": "hi"})).status_code == 202
    assert (await queued_request(aredis, keys)).deadline_ms is None


@pytest.mark.parametrize("timeout", [0, -1, 86_401, "5", True, None])
async def test_bad_timeout_is_400(client, aredis, keys, timeout):
    response = await client.post("/v1/requests", json={"inputs": "hi", "parameters": {"timeout": timeout}})
    if timeout is None:
        assert response.status_code == 202
        return
    assert response.status_code == 400 and response.json()["error"]["param"] == "parameters.timeout"
    assert not await aredis.exists(keys.requests())


async def test_an_expired_request_ends_expired(client, worker):
    stream = asyncio.create_task(client.post("/generate_stream", json={"inputs": "hi", "parameters": {"timeout": 1}}))
    request = await worker.take()
    await worker.end(request.id, 0, RequestStatus.EXPIRED, "expired")  # as the router ends it
    events = [json.loads(line[5:]) for line in (await stream).text.splitlines() if line.startswith("data:")]
    assert events[-1]["finished"] and events[-1]["finish_reason"] == "expired"
    view = (await client.get(f"/v1/requests/{request.id}")).json()
    assert view["status"] == "expired" and view["finish_reason"] == "expired"
