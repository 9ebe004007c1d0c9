"""Prometheus metrics of one producer app (a registry per app, no globals).

Two kinds of series. The route counters (accepted, rejected, prompt tokens,
disconnects) count what this replica did. Everything else is the cluster
as Redis shows it (``producer.cluster``), read at scrape time, so every
replica reports the same numbers: aggregate those with ``max``, not
``sum``, when several producers are scraped. Latency histograms and the
generation counter are observed once per request, here, when a scrape
first sees it ended: TTFT and end-to-end from its ingress entry to its
chunks' entry ids, inter-token gaps between consecutive chunks (Redis's
clock throughout, millisecond resolution), queue time from its status hash.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from producer.cluster import ClusterSnapshot, RecentRequest, RequestTracker, kv_usage, read_cluster, token_times_ms
from shared.keys import ROUTER_GROUP, WORKER_GROUP, Keys

WORKER_FIELDS = {
    "used_tokens": "lightq:worker_used_tokens",
    "committed_tokens": "lightq:worker_committed_tokens",
    "max_total_tokens": "lightq:worker_max_total_tokens",
    "num_running": "lightq:worker_running_requests",
    "num_waiting": "lightq:worker_waiting_requests",
}
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
HISTORY_S = 600  # seconds of (queue depth, throughput) samples kept for the dashboard's plots
OBSERVE_MAX = 500  # ended requests observed per scrape (bounds a first scrape after a restart)


@dataclass(frozen=True)
class Latency:
    ttft_s: float | None
    e2e_s: float | None


class ProducerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.accepted = Counter("lightq:requests_accepted", "requests enqueued", ["route"], registry=reg)
        self.rejected = Counter("lightq:requests_rejected", "requests refused before enqueue", ["reason"],
                                registry=reg)
        self.prompt_tokens = Counter("lightq:prompt_tokens", "prompt tokens of accepted requests", registry=reg)
        self.disconnects = Counter("lightq:client_disconnects", "requests cancelled because the client left",
                                   registry=reg)
        self._cluster_gauges(reg)
        self._latency_metrics(reg)
        self.history: deque[dict] = deque(maxlen=HISTORY_S)
        self.latencies: dict[str, Latency] = {}  # ended requests already observed
        self.tracker = RequestTracker()
        self._lock = asyncio.Lock()

    def _cluster_gauges(self, reg: CollectorRegistry) -> None:
        g = lambda name, doc, labels=(): Gauge(name, doc, labels, registry=reg)  # noqa: E731
        self.ingress_depth = g("lightq:ingress_queue_depth", "requests not yet routed (lag + pending)")
        self.queue_tokens = g("lightq:queue_tokens", "tokens of the queued requests: prompt, and predicted "
                              "output (mean of recent output lengths, capped by max_new_tokens)", ["kind"])
        self.stream_lag = g("lightq:stream_lag", "entries never delivered to the group", ["stream", "group"])
        self.stream_pending = g("lightq:stream_pending", "entries delivered, not acknowledged", ["stream", "group"])
        self.inbox_depth = g("lightq:worker_inbox_depth", "dispatched, not finished (lag + pending)", ["worker"])
        self.worker_gauges = {name: g(metric, f"WorkerLoad.{name} from the worker's heartbeat", ["worker"])
                              for name, metric in WORKER_FIELDS.items()}
        self.kv_usage = g("lightq:worker_kv_usage_ratio", "KV pool tokens in use / pool size", ["worker"])
        self.live_workers = g("lightq:live_workers", "workers with a current heartbeat")
        self.dead_letters = g("lightq:dead_letters", "entries in the dead-letter stream")
        self.throughput = g("lightq:throughput_tokens_per_second",
                            "prompt + output tokens of requests finished in the last minute, per second")
        self.generation_rate = g("lightq:generation_tokens_per_second",
                                 "output tokens of requests finished in the last minute, per second")
        self.drain_rate = g("lightq:queue_drain_requests_per_second", "requests dispatched in the last minute, per second")
        self.arrival_rate = g("lightq:queue_arrival_requests_per_second", "requests enqueued in the last minute, per second")
        self.backlog = g("lightq:backlog_gpu_seconds", "queued tokens / recent throughput: seconds of pool "
                         "time to drain the queue (the autoscaling signal)")

    def _latency_metrics(self, reg: CollectorRegistry) -> None:
        self.ttft = Histogram("lightq:time_to_first_token_seconds", "enqueue -> first output token",
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("lightq:inter_token_latency_seconds", "gap between consecutive output tokens",
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("lightq:e2e_request_latency_seconds", "enqueue -> last output token",
                             buckets=E2E_BUCKETS, registry=reg)
        self.queue_time = Histogram("lightq:request_queue_time_seconds", "enqueue -> dispatch to a worker",
                                    buckets=E2E_BUCKETS, registry=reg)
        self.generation_tokens = Counter("lightq:generation_tokens", "output tokens of ended requests", registry=reg)
        self.ended = Counter("lightq:requests_ended", "requests that ended, by status", ["status"], registry=reg)

    async def refresh(self, redis: aioredis.Redis, keys: Keys) -> ClusterSnapshot:
        """Read the cluster, observe newly ended requests, set every gauge; one at a time."""
        async with self._lock:
            snap = await read_cluster(redis, keys, self.tracker)
            await self._observe_ended(redis, keys, snap.recent)
            self._apply(snap, keys)
            self._sample(snap)
            return snap

    async def render(self, redis: aioredis.Redis, keys: Keys) -> bytes:
        await self.refresh(redis, keys)
        return generate_latest(self.registry)

    async def _observe_ended(self, redis: aioredis.Redis, keys: Keys, recent: list[RecentRequest]) -> None:
        ended = [r for r in recent if r.is_terminal and r.id not in self.latencies][:OBSERVE_MAX]
        pipe = redis.pipeline(transaction=False)
        for request in ended:
            pipe.xrange(keys.chunks(request.id))
        for request, entries in zip(ended, await pipe.execute()):
            self.latencies[request.id] = self._observe(request, token_times_ms(entries))
        live = {r.id for r in recent}
        for request_id in [i for i in self.latencies if i not in live]:
            del self.latencies[request_id]

    def _observe(self, request: RecentRequest, times_ms: list[int]) -> Latency:
        self.ended.labels(status=request.status).inc()
        self.generation_tokens.inc(request.output_tokens)
        if request.dispatched_ms is not None:
            self.queue_time.observe(max(0, request.dispatched_ms - request.created_ms) / 1000)
        if not times_ms:
            return Latency(None, None)
        ttft = max(0, times_ms[0] - request.enqueued_ms) / 1000
        e2e = max(0, times_ms[-1] - request.enqueued_ms) / 1000
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        for before, after in zip(times_ms, times_ms[1:]):
            self.itl.observe((after - before) / 1000)
        return Latency(ttft, e2e)

    def _apply(self, snap: ClusterSnapshot, keys: Keys) -> None:
        # One synchronous block: concurrent scrapes never see half-cleared labels.
        self.ingress_depth.set(snap.ingress.total)
        self.queue_tokens.labels(kind="prompt").set(snap.queue_prompt_tokens)
        self.queue_tokens.labels(kind="predicted_output").set(snap.queue_output_tokens)
        for gauge in (self.stream_lag, self.stream_pending, self.inbox_depth, self.kv_usage,
                      *self.worker_gauges.values()):
            gauge.clear()
        self.stream_lag.labels(stream=keys.requests(), group=ROUTER_GROUP).set(snap.ingress.lag)
        self.stream_pending.labels(stream=keys.requests(), group=ROUTER_GROUP).set(snap.ingress.pending)
        for load in snap.loads:
            worker, inbox = load.worker_id, snap.inboxes[load.worker_id]
            self.inbox_depth.labels(worker=worker).set(inbox.total)
            self.stream_lag.labels(stream=keys.inbox(worker), group=WORKER_GROUP).set(inbox.lag)
            self.stream_pending.labels(stream=keys.inbox(worker), group=WORKER_GROUP).set(inbox.pending)
            self.kv_usage.labels(worker=worker).set(kv_usage(load))
            for name, gauge in self.worker_gauges.items():
                gauge.labels(worker=worker).set(getattr(load, name))
        self.live_workers.set(len(snap.loads))
        self.dead_letters.set(snap.dead_letters)
        self.throughput.set(snap.throughput_tokens_per_s)
        self.generation_rate.set(snap.generation_tokens_per_s)
        self.drain_rate.set(snap.drain_rate)
        self.arrival_rate.set(snap.arrival_rate)
        self.backlog.set(snap.backlog_gpu_seconds)

    def _sample(self, snap: ClusterSnapshot) -> None:
        """At most one point a second for the dashboard's plots."""
        if self.history and snap.ts_ms - self.history[-1]["ts_ms"] < 1000:
            return
        self.history.append({"ts_ms": snap.ts_ms, "queue_depth": snap.ingress.total,
                             "queue_tokens": snap.queue_tokens,
                             "generation_tokens_per_s": round(snap.generation_tokens_per_s, 3)})
