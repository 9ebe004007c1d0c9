"""/metrics and /dashboard/data serve the last cluster view (read off the request path),
and the latency histograms count every request a client streamed, when it happened."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from producer.app import create_app
from producer.monitoring.cluster import read_cluster
from producer.monitoring.recent import RequestTracker
from shared import codec
from shared.chunk_schemas import TokenChunk
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group_async
from tests.monitoring.conftest import parse, refresh

BODY = {"inputs": [1, 2, 3], "parameters": {"max_new_tokens": 4}}
TEXTS = ["a", "b", "c", "d"]


@pytest.fixture
async def proxied(settings, tokenizer, proxy):
    """An app that reaches Redis through the proxy, with a refresh period longer than any test."""
    redis = settings.redis.model_copy(update={"url": proxy.url})
    app = create_app(
        settings.model_copy(update={"redis": redis, "redis_timeout_s": 0.5, "metrics_refresh_s": 3600}),
        tokenizer=tokenizer,
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://producer", timeout=30
        ) as client:
            yield app, client


async def test_scrapes_answer_from_the_snapshot_while_redis_is_gone(proxied, proxy):
    app, client = proxied
    assert (await client.post("/v1/requests", json=BODY)).status_code == 202
    await refresh(app)
    await proxy.cut()  # nothing on the request path may need Redis now
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert parse(response.text)[("lightq:ingress_queue_depth", ())] == 1  # the view read before the cut
    data = await client.get("/dashboard/data")
    assert data.status_code == 200 and data.json()["queue"]["depth"] == 1


async def test_the_view_is_refreshed_in_the_background(settings, tokenizer):
    app = create_app(settings.model_copy(update={"metrics_refresh_s": 0.05}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as fast:
            assert (await fast.post("/v1/requests", json=BODY)).status_code == 202
            deadline = time.monotonic() + 20  # a bound on the wait, not a measurement
            while parse((await fast.get("/metrics")).text).get(("lightq:ingress_queue_depth", ()), 0) != 1:
                assert time.monotonic() < deadline, "no refresh showed the queued request"
                await asyncio.sleep(0.05)


async def test_every_streamed_request_is_counted_after_its_records_expired(app, client, worker, aredis, keys, scrape):
    count = 12

    async def serve() -> None:
        for _ in range(count):
            await worker.generate(await worker.take(), TEXTS)

    server = asyncio.create_task(serve())
    routes = ["/generate", "/generate_stream", "/v1/completions"]
    bodies = [BODY, BODY, {"model": app.state.services.model_id, "prompt": [1, 2, 3], "max_tokens": 4}]
    responses = await asyncio.gather(*(client.post(routes[i % 3], json=bodies[i % 3]) for i in range(count)))
    await server
    assert all(r.status_code == 200 for r in responses)
    leftovers = [key async for key in aredis.scan_iter(match=f"{keys.prefix}:*")]
    await aredis.delete(*leftovers)  # every record gone, as after their TTL: nothing to rebuild from
    samples = await scrape()
    assert samples[("lightq:time_to_first_token_seconds_count", ())] == count
    assert samples[("lightq:e2e_request_latency_seconds_count", ())] == count
    assert samples[("lightq:inter_token_latency_seconds_count", ())] == count * (len(TEXTS) - 1)
    assert samples[("lightq:generation_tokens_total", ())] == count * len(TEXTS)
    assert samples[("lightq:requests_ended_total", (("status", "finished"),))] == count


async def test_a_replay_of_an_old_request_is_not_timed(client, worker, aredis, keys, scrape):
    request_id = (await client.post("/v1/requests", json=BODY)).json()["id"]
    request = await worker.take()
    old_ms = int(time.time() * 1000) - 60_000  # written a minute ago (explicit entry ids)
    for index, text in enumerate(TEXTS):
        chunk = TokenChunk(
            request_id=request.id,
            index=index,
            token_id=index,
            text=text,
            finished=index == len(TEXTS) - 1,
            finish_reason="length" if index == 3 else None,
        )
        await aredis.xadd(keys.chunks(request.id), codec.entry(chunk), id=f"{old_ms + index}-0")
    replay = await client.get(f"/v1/requests/{request_id}/stream")
    assert replay.status_code == 200 and replay.text.count("data:") == len(TEXTS)
    samples = await scrape()
    assert samples[("lightq:time_to_first_token_seconds_count", ())] == 0
    assert samples[("lightq:e2e_request_latency_seconds_count", ())] == 0


async def test_a_resumed_stream_is_not_counted_twice(client, worker, scrape):
    async def serve():
        request = await worker.take()
        return request, await worker.generate(request, TEXTS)

    server = asyncio.create_task(serve())
    response = await client.post("/generate_stream", json=BODY)
    request, entry_ids = await server
    resumed = await client.get(f"/v1/requests/{request.id}/stream", headers={"Last-Event-ID": entry_ids[1]})
    assert response.status_code == 200 and resumed.text.count("data:") == 2
    samples = await scrape()
    assert samples[("lightq:time_to_first_token_seconds_count", ())] == 1
    assert samples[("lightq:generation_tokens_total", ())] == len(TEXTS)


async def test_reads_that_reuse_parsed_entries_agree_with_fresh_ones(client, aredis, keys):
    """The view's thread parses each queued entry once; its numbers equal a reader's that keeps nothing."""
    tracker = RequestTracker()

    async def check() -> None:
        kept = await read_cluster(aredis, keys, tracker)
        fresh = await read_cluster(aredis, keys)
        assert (kept.ingress, kept.queue_prompt_tokens, kept.queue_output_tokens) == (
            fresh.ingress,
            fresh.queue_prompt_tokens,
            fresh.queue_output_tokens,
        )
        assert set(tracker.parsed) <= {entry_id for entry_id, _ in await aredis.xrange(keys.requests())}

    for n in range(1, 5):  # prompts of 1 to 4 tokens
        await client.post("/v1/requests", json={"inputs": list(range(1, n + 1)), "parameters": {"max_new_tokens": n}})
    await check()
    await ensure_group_async(aredis, keys.requests(), ROUTER_GROUP)
    delivered = await aredis.xreadgroup(ROUTER_GROUP, "r1", {keys.requests(): ">"}, count=2)
    await check()  # two pending (parsed while they were lag), two lag
    await client.post("/v1/requests", json={"inputs": [7] * 9, "parameters": {"max_new_tokens": 5}})
    await check()  # one more, after the known ones
    await aredis.xack(keys.requests(), ROUTER_GROUP, delivered[0][1][0][0])
    await aredis.xreadgroup(ROUTER_GROUP, "r1", {keys.requests(): ">"}, count=1)
    await check()
    snap = await read_cluster(aredis, keys, tracker)
    assert snap.ingress.total == 4 and snap.queue_prompt_tokens == 2 + 3 + 4 + 9


async def test_an_ended_request_is_read_once_then_again_after_a_requeue(client, aredis, keys):
    """The view reads live requests' status hashes at every refresh, an ended one's no more (a
    terminal status is final: reading it again was most of a burst's HGETALLs); an operator's
    requeue (a new ingress entry of the same id) makes it live again."""
    tracker = RequestTracker()
    request_id = (await client.post("/v1/requests", json=BODY)).json()["id"]
    now_ms = int(time.time() * 1000)

    async def seen() -> list[tuple[str, int]]:
        return [(r.status, r.output_tokens) for r in await tracker.refresh(aredis, keys, now_ms) if r.id == request_id]

    assert await seen() == [("queued", 0)]
    await aredis.hset(keys.meta(request_id), mapping={"status": "finished", "output_tokens": 4, "finished_ms": now_ms})
    assert await seen() == [("finished", 4)]
    await aredis.hset(keys.meta(request_id), "output_tokens", 9)
    assert await seen() == [("finished", 4)]  # not read again
    entry = (await aredis.xrange(keys.requests()))[-1][1]
    await aredis.hset(keys.meta(request_id), "status", "queued")
    await aredis.xadd(keys.requests(), entry)
    assert await seen() == [("queued", 9)]
