"""/metrics (queue depths and worker gauges read from Redis, off the request path) and /health."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from producer.app import create_app
from shared.config import RedisSettings
from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.producer_settings import ProducerSettings
from shared.redis import ensure_group_async
from shared.worker_load import WorkerLoad


async def scrape(client, app) -> dict[tuple[str, tuple], float]:
    """/metrics after a read of the cluster view now (on its thread, as every --metrics_refresh_s)."""
    await app.state.cluster_view.refresh_now()
    response = await client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }


async def test_ingress_depth_follows_the_router_group(app, client, aredis, keys):
    assert (await scrape(client, app))[("lightq:ingress_queue_depth", ())] == 0  # no stream yet
    response = await client.post("/v1/requests", json={"inputs": [1, 2, 3, 4]})
    assert response.status_code == 202
    samples = await scrape(client, app)
    assert samples[("lightq:ingress_queue_depth", ())] == 1  # no router group yet: every entry waits
    assert samples[("lightq:requests_accepted_total", (("route", "requests"),))] == 1
    assert samples[("lightq:prompt_tokens_total", ())] == 4

    await ensure_group_async(aredis, keys.requests(), ROUTER_GROUP)
    assert (await scrape(client, app))[("lightq:ingress_queue_depth", ())] == 1  # lag 1
    await aredis.xreadgroup(ROUTER_GROUP, "r1", {keys.requests(): ">"}, count=1)
    assert (await scrape(client, app))[("lightq:ingress_queue_depth", ())] == 1  # pending 1
    entries = await aredis.xrange(keys.requests())
    await aredis.xack(keys.requests(), ROUTER_GROUP, entries[0][0])
    assert (await scrape(client, app))[("lightq:ingress_queue_depth", ())] == 0
    await aredis.xdel(keys.requests(), entries[0][0])  # deleted entries make Redis report lag as nil
    await client.post("/v1/requests", json={"inputs": [1]})
    assert (await scrape(client, app))[("lightq:ingress_queue_depth", ())] == 1


async def test_worker_gauges_for_live_workers_only(app, client, aredis, keys):
    load = WorkerLoad(
        worker_id="w1",
        seq=3,
        ts_ms=1,
        max_total_tokens=8192,
        used_tokens=300,
        committed_tokens=900,
        num_running=2,
        num_waiting=1,
        requests=[],
    )
    await aredis.zadd(keys.workers(), {"w1": 1, "gone": 1})  # "gone" has no heartbeat any more
    await aredis.set(keys.load("w1"), load.model_dump_json(), ex=60)
    await ensure_group_async(aredis, keys.inbox("w1"), WORKER_GROUP)
    for n in range(3):
        await aredis.xadd(keys.inbox("w1"), {"msg": str(n)})
    await aredis.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"}, count=1)
    samples = await scrape(client, app)
    w1 = (("worker", "w1"),)
    assert samples[("lightq:worker_inbox_depth", w1)] == 3
    assert samples[("lightq:worker_used_tokens", w1)] == 300
    assert samples[("lightq:worker_max_total_tokens", w1)] == 8192
    assert samples[("lightq:worker_running_requests", w1)] == 2
    assert samples[("lightq:worker_waiting_requests", w1)] == 1
    assert not any(labels == (("worker", "gone"),) for _, labels in samples)

    await aredis.delete(keys.load("w1"))  # heartbeat expired: the worker's series disappear
    assert not any(labels == w1 for _, labels in await scrape(client, app))


async def test_health(client):
    for path in ("/health", "/healthz"):
        response = await client.get(path)
        assert response.status_code == 200 and response.json() == {"message": "Ok"}


async def test_health_without_redis(tokenizer, redis_settings):
    settings = ProducerSettings(redis=RedisSettings(url="redis://127.0.0.1:1/0", key_prefix=redis_settings.key_prefix))
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            response = await client.get("/health")
            assert response.status_code == 503 and response.json() == {"message": "Error"}
            response = await client.post("/generate", json={"inputs": "hi"})
            assert response.status_code == 503 and response.json()["error"]["code"] == "redis_unavailable"
