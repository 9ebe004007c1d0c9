"""The producer's /metrics against a real Redis: names, queue depth and tokens,
lags, worker gauges, dead letters, latency histograms and the backlog signal."""

from __future__ import annotations

import asyncio

import pytest

from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.redis import ensure_group_async
from shared.worker_load import WorkerLoad

NAMES = [
    "lightq:ingress_queue_depth",
    "lightq:queue_tokens",
    "lightq:stream_lag",
    "lightq:stream_pending",
    "lightq:worker_inbox_depth",
    "lightq:worker_running_requests",
    "lightq:worker_waiting_requests",
    "lightq:worker_used_tokens",
    "lightq:worker_max_total_tokens",
    "lightq:worker_kv_usage_ratio",
    "lightq:live_workers",
    "lightq:dead_letters",
    "lightq:throughput_tokens_per_second",
    "lightq:generation_tokens_per_second",
    "lightq:queue_drain_requests_per_second",
    "lightq:backlog_gpu_seconds",
    "lightq:time_to_first_token_seconds_count",
    "lightq:inter_token_latency_seconds_count",
    "lightq:e2e_request_latency_seconds_count",
    "lightq:generation_tokens_total",
    "lightq:prompt_tokens_total",
    "lightq:cluster_view_timestamp_seconds",
]


def body(ids, max_new, ignore_eos=False):
    return {"inputs": ids, "parameters": {"max_new_tokens": max_new, "ignore_eos": ignore_eos}}


async def test_every_name_is_exported_with_the_lightq_prefix(client, scrape, aredis, keys):
    load = WorkerLoad(
        worker_id="w1",
        seq=1,
        ts_ms=1,
        max_total_tokens=100,
        used_tokens=1,
        committed_tokens=1,
        num_running=1,
        num_waiting=0,
        requests=[],
    )
    await aredis.set(keys.load("w1"), load.model_dump_json(), ex=60)
    await aredis.zadd(keys.workers(), {"w1": 1})
    response = await client.get("/metrics")
    names = {name for name, _ in await scrape()}
    assert not [n for n in NAMES if n not in names]
    declared = [line.split()[2] for line in response.text.splitlines() if line.startswith("# TYPE")]
    assert declared and all(name.startswith("lightq:") for name in declared)


async def test_queue_entries_and_tokens_use_the_output_length_history(client, scrape, aredis, keys):
    assert (await client.post("/v1/requests", json=body([1, 2, 3, 4], 10))).status_code == 202
    assert (await client.post("/v1/requests", json=body([5, 6], 8, ignore_eos=True))).status_code == 202
    samples = await scrape()
    assert samples[("lightq:ingress_queue_depth", ())] == 2
    assert samples[("lightq:queue_tokens", (("kind", "prompt"),))] == 6
    # No history yet: every request is expected to use its whole max_new_tokens.
    assert samples[("lightq:queue_tokens", (("kind", "predicted_output"),))] == 18
    await aredis.lpush(keys.output_lengths(), 4, 6)  # mean 5: caps the first, not the ignore_eos one
    samples = await scrape()
    assert samples[("lightq:queue_tokens", (("kind", "predicted_output"),))] == 5 + 8
    # Nothing finished lately: the backlog is the queued tokens over the 1 token/s floor.
    assert samples[("lightq:backlog_gpu_seconds", ())] == 6 + 13


async def test_lag_and_pending_per_stream(client, scrape, aredis, keys):
    for _ in range(3):
        await client.post("/v1/requests", json=body([1], 4))
    await ensure_group_async(aredis, keys.requests(), ROUTER_GROUP)
    await aredis.xreadgroup(ROUTER_GROUP, "r1", {keys.requests(): ">"}, count=1)
    ingress = (("group", ROUTER_GROUP), ("stream", keys.requests()))
    samples = await scrape()
    assert samples[("lightq:stream_lag", ingress)] == 2 and samples[("lightq:stream_pending", ingress)] == 1
    assert samples[("lightq:ingress_queue_depth", ())] == 3
    assert samples[("lightq:queue_tokens", (("kind", "prompt"),))] == 3  # pending entries count too

    load = WorkerLoad(
        worker_id="w1",
        seq=1,
        ts_ms=1,
        max_total_tokens=1000,
        used_tokens=250,
        committed_tokens=400,
        num_running=2,
        num_waiting=3,
        requests=[],
    )
    await aredis.zadd(keys.workers(), {"w1": 1})
    await aredis.set(keys.load("w1"), load.model_dump_json(), ex=60)
    await ensure_group_async(aredis, keys.inbox("w1"), WORKER_GROUP)
    for n in range(4):
        await aredis.xadd(keys.inbox("w1"), {"msg": str(n)})
    await aredis.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"}, count=3)
    inbox = (("group", WORKER_GROUP), ("stream", keys.inbox("w1")))
    w1 = (("worker", "w1"),)
    samples = await scrape()
    assert samples[("lightq:stream_lag", inbox)] == 1 and samples[("lightq:stream_pending", inbox)] == 3
    assert samples[("lightq:worker_kv_usage_ratio", w1)] == 0.25
    assert samples[("lightq:worker_committed_tokens", w1)] == 400
    assert samples[("lightq:worker_waiting_requests", w1)] == 3
    assert samples[("lightq:live_workers", ())] == 1


async def test_dead_letters_are_the_dead_stream_length(scrape, aredis, keys):
    assert (await scrape())[("lightq:dead_letters", ())] == 0
    for n in range(2):
        await aredis.xadd(keys.dead_letters(), {"msg": "x", "reason": f"test {n}"})
    assert (await scrape())[("lightq:dead_letters", ())] == 2


async def generate_with(client, worker, texts, delay_s=0.0):
    """/generate answered by the fake worker; returns (the request as queued, the response)."""

    async def serve():
        request = await worker.take()
        await worker.generate(request, texts, delay_s=delay_s)
        return request

    task = asyncio.create_task(serve())
    response = await client.post("/generate", json=body([1, 2, 3, 4], len(texts)))
    assert response.status_code == 200
    return await task, response


async def test_latencies_and_tokens_observed_once_per_answered_request(client, scrape, worker):
    await generate_with(client, worker, ["a", "b", "c"], delay_s=0.05)
    for _ in range(2):  # a second scrape observes nothing twice
        samples = await scrape()
        assert samples[("lightq:time_to_first_token_seconds_count", ())] == 1
        assert samples[("lightq:e2e_request_latency_seconds_count", ())] == 1
        assert samples[("lightq:inter_token_latency_seconds_count", ())] == 2
        assert samples[("lightq:generation_tokens_total", ())] == 3
        assert samples[("lightq:requests_ended_total", (("status", "finished"),))] == 1
    ttft = samples[("lightq:time_to_first_token_seconds_sum", ())]
    e2e = samples[("lightq:e2e_request_latency_seconds_sum", ())]
    # One clock for all three: the last token's arrival is the first's plus the gaps.
    assert 0 < ttft <= e2e and e2e - ttft == pytest.approx(samples[("lightq:inter_token_latency_seconds_sum", ())])
    # 4 prompt + 3 output tokens finished within the window.
    assert samples[("lightq:throughput_tokens_per_second", ())] == pytest.approx(7 / 60)
    assert samples[("lightq:generation_tokens_per_second", ())] == pytest.approx(3 / 60)
    assert samples[("lightq:queue_drain_requests_per_second", ())] == pytest.approx(1 / 60)


async def test_backlog_is_queued_tokens_over_recent_throughput(client, scrape, worker, aredis, keys):
    await client.post("/v1/requests", json=body(list(range(1, 101)), 20))
    request = await worker.take()
    await worker.generate(request, ["x"] * 20)
    await aredis.lpush(keys.output_lengths(), 20)
    for _ in range(3):
        await client.post("/v1/requests", json=body([1] * 10, 50))
    samples = await scrape()
    throughput = (100 + 20) / 60
    queued = 3 * (10 + 20)
    assert samples[("lightq:queue_tokens", (("kind", "predicted_output"),))] == 60
    assert samples[("lightq:throughput_tokens_per_second", ())] == pytest.approx(throughput)
    assert samples[("lightq:backlog_gpu_seconds", ())] == pytest.approx(queued / max(throughput, 1.0))


async def test_requests_trimmed_off_the_ingress_stream_are_still_followed(client, scrape, worker, aredis, keys):
    await client.post("/v1/requests", json=body([1, 2], 2))
    request = await worker.take()
    assert (await scrape())[("lightq:ingress_queue_depth", ())] == 0  # seen once, dispatched
    await aredis.xtrim(keys.requests(), maxlen=0)  # what housekeeping does to dispatched entries
    await worker.generate(request, ["a", "b"])
    samples = await scrape()
    assert samples[("lightq:generation_tokens_per_second", ())] == pytest.approx(2 / 60)
    # Submitted and polled, never streamed: no client saw its tokens arrive, nothing is timed.
    assert samples[("lightq:time_to_first_token_seconds_count", ())] == 0
