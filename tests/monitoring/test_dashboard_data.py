"""/dashboard serves one self-contained page; /dashboard/data carries the /metrics numbers."""

from __future__ import annotations

import re

import pytest

from shared.worker_load import WorkerLoad
from tests.monitoring.conftest import parse, refresh
from tests.monitoring.test_producer_metrics import generate_with


async def test_page_is_self_contained(client):
    response = await client.get("/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    assert "dashboard/data" in html and "<svg" in html
    # Nothing fetched from elsewhere: no external scripts, styles, fonts or images.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html


async def test_data_equals_metrics(app, client, worker, aredis, keys):
    load = WorkerLoad(
        worker_id="w1",
        seq=1,
        ts_ms=1,
        max_total_tokens=2000,
        used_tokens=500,
        committed_tokens=700,
        num_running=3,
        num_waiting=1,
        requests=[],
        cached_tokens=300,
        prefix_asked_tokens=400,
        prefix_hit_tokens=100,
        prefix_evicted_tokens=64,
        preempted_requests=3,
        preempted_kv_tokens=420,
    )
    await aredis.zadd(keys.workers(), {"w1": 1})
    await aredis.set(keys.load("w1"), load.model_dump_json(), ex=60)
    await aredis.xadd(keys.dead_letters(), {"msg": "x", "reason": "test"})
    await aredis.hset(keys.router_decisions(), mapping={"prefix_hit": 5, "least_loaded": 2})  # as routers write it
    # router.order.ordering's counters, as routers write them: a tenant can have a ':' in its name
    await aredis.hset(keys.tenant_queued(), mapping={"1:batch:a": 4, "0:chat": 2})
    await aredis.hset(keys.tenant_served(), mapping={"0:chat": 900, "1:batch:a": 5000, "1:idle": 70})
    request, _ = await generate_with(client, worker, ["a", "b"])
    await client.post("/v1/requests", json={"inputs": [4, 5], "parameters": {"max_new_tokens": 7}})

    await refresh(app)  # both routes serve the snapshot this read makes
    data = (await client.get("/dashboard/data")).json()
    samples = parse((await client.get("/metrics")).text)
    assert data["ts_ms"] / 1000 == samples[("lightq:cluster_view_timestamp_seconds", ())]
    assert data["queue"]["depth"] == samples[("lightq:ingress_queue_depth", ())] == 1
    assert data["queue"]["prompt_tokens"] == samples[("lightq:queue_tokens", (("kind", "prompt"),))] == 2
    assert data["queue"]["predicted_output_tokens"] == samples[("lightq:queue_tokens", (("kind", "predicted_output"),))]
    assert data["backlog_gpu_seconds"] == pytest.approx(samples[("lightq:backlog_gpu_seconds", ())])
    assert data["dead_letters"] == samples[("lightq:dead_letters", ())] == 1
    assert data["live_workers"] == samples[("lightq:live_workers", ())] == 1
    assert data["rates"]["generation_tokens_per_s"] == pytest.approx(
        samples[("lightq:generation_tokens_per_second", ())]
    )
    assert data["totals"]["generation_tokens"] == samples[("lightq:generation_tokens_total", ())] == 2
    [w1] = data["workers"]
    assert w1["kv_usage"] == samples[("lightq:worker_kv_usage_ratio", (("worker", "w1"),))] == 0.25
    assert (w1["running"], w1["waiting"], w1["max_total_tokens"]) == (3, 1, 2000)
    label = (("worker", "w1"),)
    assert w1["cached_tokens"] == samples[("lightq:worker_prefix_cached_tokens", label)] == 300
    assert w1["prefix_hit_ratio"] == samples[("lightq:worker_prefix_hit_ratio", label)] == 0.25
    assert w1["prefix_evicted_tokens"] == samples[("lightq:worker_prefix_evicted_tokens_total", label)] == 64
    assert w1["preempted_requests"] == samples[("lightq:worker_priority_preemptions_total", label)] == 3
    assert w1["preempted_kv_tokens"] == samples[("lightq:worker_preempted_kv_tokens_total", label)] == 420
    priorities = data["priorities"]
    assert priorities["classes"] == {"0": 2, "1": 4}
    for c, n in priorities["classes"].items():
        assert samples[("lightq:queue_class_depth", (("priority", c),))] == n
    assert [(t["priority"], t["tenant"], t["queued"], t["dispatched_tokens"]) for t in priorities["tenants"]] == [
        (0, "chat", 2, 900),
        (1, "batch:a", 4, 5000),
        (1, "idle", 0, 70),
    ]
    for t in priorities["tenants"]:
        labels = (("priority", str(t["priority"])), ("tenant", t["tenant"]))
        assert samples[("lightq:tenant_dispatched_tokens_total", labels)] == t["dispatched_tokens"]
        assert samples.get(("lightq:queue_tenant_depth", labels), 0) == t["queued"]
    assert data["router_decisions"] == {"least_loaded": 2, "prefix_hit": 5}
    for reason, n in data["router_decisions"].items():
        assert samples[("lightq:router_decisions_total", (("reason", reason),))] == n
    statuses = {row["id"]: row for row in data["recent"]}
    assert statuses[request.id]["status"] == "finished" and statuses[request.id]["output_tokens"] == 2
    assert statuses[request.id]["ttft_s"] is not None
    assert [row["status"] for row in data["recent"]] == ["queued", "finished"]  # newest first
    assert data["history"] and data["history"][-1]["ts_ms"] <= data["ts_ms"]  # a point a second at most
