"""Prometheus metrics of one producer app (a registry per app, no globals).

Two kinds of series:

- Counters and histograms of what this process did, observed when it
  happens: route counters (accepted, rejected, prompt tokens, disconnects)
  and what clients saw of their requests (time to first token, inter-token
  latency, end-to-end, tokens delivered, requests ended), observed by the
  stream hub as chunks arrive (``producer.monitoring.client_latency``). Nothing is
  rebuilt from request records, so a scrape after a run counts every
  request of it. With ``--producers N`` they live in prometheus_client's
  multiprocess files (``multiprocess_dir``) and any process's ``/metrics``
  shows the sum over all N; replicas on other hosts add up with ``sum``.
- The cluster as Redis shows it (``producer.monitoring.cluster``): gauges computed by
  ``refresh`` off the request path (on the ``producer.monitoring.cluster_view`` thread,
  every ``--metrics_refresh_s``) and served from the last snapshot, so ``/metrics`` and
  ``/dashboard/data`` never wait on Redis. Every process and replica
  reports the same numbers: aggregate those with ``max``, not ``sum``.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from producer.monitoring.cluster import ClusterSnapshot, kv_usage, prefix_hit_ratio, read_cluster
from producer.monitoring.recent import RequestTracker
from shared.keys import ROUTER_GROUP, WORKER_GROUP, Keys
from shared.tenant_series import top_tenants

WORKER_FIELDS = {
    "used_tokens": ("lightq:worker_used_tokens", "WorkerLoad.used_tokens from the worker's heartbeat"),
    "committed_tokens": ("lightq:worker_committed_tokens", "WorkerLoad.committed_tokens from the heartbeat"),
    "max_total_tokens": ("lightq:worker_max_total_tokens", "WorkerLoad.max_total_tokens from the heartbeat"),
    "num_running": ("lightq:worker_running_requests", "WorkerLoad.num_running from the heartbeat"),
    "num_waiting": ("lightq:worker_waiting_requests", "WorkerLoad.num_waiting from the heartbeat"),
    "cached_tokens": ("lightq:worker_prefix_cached_tokens", "WorkerLoad.cached_tokens: tokens its prefix cache holds"),
}
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    80.0,
)
E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
HISTORY_S = 600  # seconds of (queue depth, throughput) samples kept for the dashboard's plots


class _Snapshot(Collector):
    """The last cluster view's gauges, built once per refresh (a scrape only formats them)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class ProducerMetrics:
    def __init__(self, multiprocess_dir: str | None = None, metrics_tenants: int = 16) -> None:
        self.metrics_tenants = metrics_tenants  # tenant series per class (shared.tenant_series)
        self.registry = CollectorRegistry(auto_describe=True)  # this process's counters and histograms
        reg = self.registry
        self.accepted = Counter("lightq:requests_accepted", "requests enqueued", ["route"], registry=reg)
        self.rejected = Counter("lightq:requests_rejected", "requests refused before enqueue", ["reason"], registry=reg)
        self.prompt_tokens = Counter("lightq:prompt_tokens", "prompt tokens of accepted requests", registry=reg)
        self.disconnects = Counter(
            "lightq:client_disconnects", "requests cancelled because the client left", registry=reg
        )
        self.ttft = Histogram(
            "lightq:time_to_first_token_seconds",
            "reader joined (request queued) -> first output token reached this producer",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "lightq:inter_token_latency_seconds",
            "gap between consecutive output tokens of a sample reaching this producer",
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "lightq:e2e_request_latency_seconds",
            "reader joined (request queued) -> last chunk reached this producer",
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.generation_tokens = Counter("lightq:generation_tokens", "output tokens delivered to clients", registry=reg)
        self.ended = Counter(
            "lightq:requests_ended", "requests whose end reached a client, by status", ["status"], registry=reg
        )
        self._snapshot = _Snapshot()
        self.exposition = self._exposition(multiprocess_dir)
        self.snapshot: ClusterSnapshot | None = None  # the last cluster view (None before the first)
        self.history: tuple[dict, ...] = ()  # at most HISTORY_S points, oldest first
        self.tracker = RequestTracker()

    def _exposition(self, multiprocess_dir: str | None) -> CollectorRegistry:
        """What ``/metrics`` renders: counters and histograms (this process's, or every process's
        from the multiprocess files), plus this process's last cluster view."""
        if multiprocess_dir is None:
            self.registry.register(self._snapshot)
            return self.registry
        exposition = CollectorRegistry()
        MultiProcessCollector(exposition, path=multiprocess_dir)
        exposition.register(self._snapshot)
        return exposition

    def render(self) -> bytes:
        """The exposition text; reads no Redis (the cluster gauges are the last ``refresh``'s)."""
        return generate_latest(self.exposition)

    async def refresh(self, redis: aioredis.Redis, keys: Keys) -> ClusterSnapshot:
        """Read the cluster and make it the served snapshot. One caller only, the cluster-view
        thread (``producer.monitoring.cluster_view``): ``tracker`` is its state. Readers on other threads
        see whole objects, each swapped in by one assignment, never one being filled."""
        snap = await read_cluster(redis, keys, self.tracker)
        self._snapshot.families = cluster_families(snap, keys, self.metrics_tenants)
        self.snapshot = snap
        self._sample(snap)
        return snap

    def _sample(self, snap: ClusterSnapshot) -> None:
        """At most one point a second for the dashboard's plots."""
        if self.history and snap.ts_ms - self.history[-1]["ts_ms"] < 1000:
            return
        point = {
            "ts_ms": snap.ts_ms,
            "queue_depth": snap.ingress.total,
            "queue_tokens": snap.queue_tokens,
            "generation_tokens_per_s": round(snap.generation_tokens_per_s, 3),
        }
        self.history = (*self.history[1 - HISTORY_S :], point)  # a new tuple: readers never see one grow


def _ordering_families(snap: ClusterSnapshot, gauge, out: list[Metric], k: int) -> None:
    """router.order.ordering's counters: requests queued per class and per (class, tenant), tokens
    dispatched per (class, tenant); per class ``k`` tenants and ``other`` (``shared.tenant_series``)."""
    per_class: dict[int, int] = {}
    for (priority, _), n in snap.tenant_queued.items():
        per_class[priority] = per_class.get(priority, 0) + n
    depth = gauge(
        "lightq:queue_class_depth", "requests queued per priority class (read by a router)", labels=("priority",)
    )
    for priority, n in sorted(per_class.items()):
        depth.add_metric([str(priority)], n)
    tenants = gauge(
        "lightq:queue_tenant_depth", "requests queued per priority class and tenant", labels=("priority", "tenant")
    )
    for (priority, tenant), n in sorted(top_tenants(snap.tenant_queued, k, sum_rest=True).items()):
        tenants.add_metric([str(priority), tenant], n)
    served = CounterMetricFamily(
        "lightq:tenant_dispatched_tokens",
        "tokens dispatched per priority class and tenant (prompt + max_new_tokens per open sample); "
        "the --metrics_tenants tenants with the most, and other",
        labels=("priority", "tenant"),
    )
    for (priority, tenant), n in sorted(top_tenants(snap.tenant_served, k, sum_rest=False).items()):
        served.add_metric([str(priority), tenant], n)
    out.append(served)


def cluster_families(snap: ClusterSnapshot, keys: Keys, metrics_tenants: int = 16) -> list[Metric]:
    """Every cluster gauge of one snapshot; a worker gone from it is gone from the families."""

    def gauge(name: str, doc: str, value: float | None = None, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, value=value, labels=None if value is not None else labels)
        out.append(family)
        return family

    out: list[Metric] = []
    gauge("lightq:ingress_queue_depth", "requests not yet routed (lag + pending)", snap.ingress.total)
    tokens = gauge(
        "lightq:queue_tokens",
        "tokens of the queued requests: prompt, and predicted output (mean of "
        "recent output lengths, capped by max_new_tokens)",
        labels=("kind",),
    )
    tokens.add_metric(["prompt"], snap.queue_prompt_tokens)
    tokens.add_metric(["predicted_output"], snap.queue_output_tokens)
    lag = gauge("lightq:stream_lag", "entries never delivered to the group", labels=("stream", "group"))
    pending = gauge("lightq:stream_pending", "entries delivered, not acknowledged", labels=("stream", "group"))
    lag.add_metric([keys.requests(), ROUTER_GROUP], snap.ingress.lag)
    pending.add_metric([keys.requests(), ROUTER_GROUP], snap.ingress.pending)
    inbox = gauge("lightq:worker_inbox_depth", "dispatched, not finished (lag + pending)", labels=("worker",))
    kv = gauge("lightq:worker_kv_usage_ratio", "KV pool tokens in use / pool size", labels=("worker",))
    hits = gauge(
        "lightq:worker_prefix_hit_ratio",
        "prompt tokens found in the worker's prefix cache / tokens it looked up, since it started",
        labels=("worker",),
    )
    evicted = CounterMetricFamily(
        "lightq:worker_prefix_evicted_tokens", "cached tokens the worker evicted to make room", labels=("worker",)
    )
    out.append(evicted)
    preempted = CounterMetricFamily(
        "lightq:worker_priority_preemptions",
        "started requests the worker paused for a better priority class, since it started (router --preempt)",
        labels=("worker",),
    )
    recomputed = CounterMetricFamily(
        "lightq:worker_preempted_kv_tokens",
        "K/V tokens of those paused requests, computed again where they resume: preemption's cost",
        labels=("worker",),
    )
    out += [preempted, recomputed]
    fields = {name: gauge(metric, doc, labels=("worker",)) for name, (metric, doc) in WORKER_FIELDS.items()}
    for load in snap.loads:
        worker, backlog = load.worker_id, snap.inboxes[load.worker_id]
        inbox.add_metric([worker], backlog.total)
        lag.add_metric([keys.inbox(worker), WORKER_GROUP], backlog.lag)
        pending.add_metric([keys.inbox(worker), WORKER_GROUP], backlog.pending)
        kv.add_metric([worker], kv_usage(load))
        hits.add_metric([worker], prefix_hit_ratio(load))
        evicted.add_metric([worker], load.prefix_evicted_tokens)
        preempted.add_metric([worker], load.preempted_requests)
        recomputed.add_metric([worker], load.preempted_kv_tokens)
        for name, family in fields.items():
            family.add_metric([worker], getattr(load, name))
    gauge("lightq:live_workers", "workers with a current heartbeat", len(snap.loads))
    gauge("lightq:dead_letters", "entries in the dead-letter stream", snap.dead_letters)
    _ordering_families(snap, gauge, out, metrics_tenants)
    decisions = CounterMetricFamily(
        "lightq:router_decisions",
        "admission decisions of every router by reason (router.admission.choice.Reason; from Redis)",
        labels=("reason",),
    )
    for reason, n in sorted(snap.decisions.items()):
        decisions.add_metric([reason], n)
    out.append(decisions)
    gauge(
        "lightq:throughput_tokens_per_second",
        "prompt + output tokens of requests finished in the last minute, per second",
        snap.throughput_tokens_per_s,
    )
    gauge(
        "lightq:generation_tokens_per_second",
        "output tokens of requests finished in the last minute, per second",
        snap.generation_tokens_per_s,
    )
    gauge(
        "lightq:queue_drain_requests_per_second", "requests dispatched in the last minute, per second", snap.drain_rate
    )
    gauge(
        "lightq:queue_arrival_requests_per_second",
        "requests enqueued in the last minute, per second",
        snap.arrival_rate,
    )
    gauge(
        "lightq:backlog_gpu_seconds",
        "queued tokens / recent throughput: seconds of pool time to drain the queue (the autoscaling signal)",
        snap.backlog_gpu_seconds,
    )
    gauge(
        "lightq:cluster_view_timestamp_seconds",
        "when this process last read the cluster view from Redis (the gauges above are that read's)",
        snap.ts_ms / 1000,
    )
    return out
