"""The router's Prometheus endpoint (``--metrics_port``): its own queue and decisions.

Counters come from ``MeteredRouter.step`` (the loop's one public step);
everything else is read when scraped, on the HTTP server's thread, from
the router's public state (``queue``, ``reservations``, ``history``) and
from Redis (the workers' records, the ingress group, the dead letters).
The loop thread may change the queue mid-copy; a copy that races is
retried rather than locked, so the loop never waits for a scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.loop import Router
from router.workers.registry import read_registry
from shared import ingress
from shared.keys import ROUTER_GROUP, split_class_tenant_field
from shared.peak import ReqState
from shared.redis import group_backlog
from shared.schemas import GenerateRequest
from shared.tenant_series import top_tenants
from shared.worker_load import WorkerLoad

DECISIONS_FLUSH_S = 1.0
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouterMetrics:
    def __init__(self, router_id: str):
        # No collect() at registration: a collector reads Redis, which may be down at start-up.
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"router": router_id}
        self.dispatches = Counter(
            "lightq:router_dispatches", "requests sent to a worker's inbox", ["router"], registry=self.registry
        ).labels(**labels)
        self.pauses = Counter(
            "lightq:router_pauses",
            "steps that ended with the head of the queue fitting no worker (everything behind it waits)",
            ["router"],
            registry=self.registry,
        ).labels(**labels)
        self.decisions = Counter(
            "lightq:router_decisions",
            "admission decisions by reason (router.admission.choice.Reason): the chosen worker holds a prefix of "
            "the prompt (a LoRA request's: its adapter), others did but load won, nobody held any, or the "
            "request waits",
            ["router", "reason"],
            registry=self.registry,
        )
        self.router_id = router_id
        self.dispatch_step = Histogram(
            "lightq:router_dispatch_step_seconds",
            "duration of a step that dispatched (read, reap, admit, send)",
            ["router"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        ).labels(**labels)


class MeteredRouter(Router):
    """The router with its steps counted; behaviour unchanged. Its decisions by reason also go
    to Redis (``Keys.router_decisions``, every router's summed), at most every ``DECISIONS_FLUSH_S``,
    for the producer's dashboard, which reads Redis and not this endpoint."""

    def __init__(self, *args, metrics: RouterMetrics, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics = metrics
        self._unflushed: dict[str, int] = {}  # reason -> decisions not yet added in Redis
        self._next_flush = 0.0

    def on_decision(self, request: GenerateRequest, worker_id: str | None, seconds: float) -> None:
        super().on_decision(request, worker_id, seconds)
        reason = self.views.last_reason
        self.metrics.decisions.labels(router=self.metrics.router_id, reason=reason).inc()
        self._unflushed[reason] = self._unflushed.get(reason, 0) + 1

    def step(self) -> int:
        start = time.perf_counter()
        dispatched = super().step()
        if dispatched:
            self.metrics.dispatches.inc(dispatched)
            self.metrics.dispatch_step.observe(time.perf_counter() - start)
        elif self.queue:
            self.metrics.pauses.inc()
        self._flush_decisions()
        return dispatched

    def _flush_decisions(self) -> None:
        """One round trip; on a Redis error (the loop backs off) the counts wait for the next."""
        now = time.monotonic()
        if not self._unflushed or now < self._next_flush:
            return
        pipe = self.client.pipeline(transaction=False)
        for reason, n in self._unflushed.items():
            pipe.hincrby(self.keys.router_decisions(), reason, n)
        pipe.execute()
        self._unflushed.clear()
        self._next_flush = now + DECISIONS_FLUSH_S


def _copy(items: Iterable, tries: int = 5) -> list:
    for _ in range(tries):
        try:
            return list(items)
        except RuntimeError:  # mutated by the loop thread while copying
            continue
    return []


class RouterCollector(Collector):
    def __init__(self, router: Router):
        self.router = router

    def collect(self) -> Iterable[Metric]:
        router, rid = self.router, self.router.router_id
        yield from self._queue(router, rid)
        registry = read_registry(router.client, router.keys, int(router.settings.stale_load_s * 1000))
        workers = GaugeMetricFamily(
            "lightq:router_workers", "workers by state as this router sees them", labels=["router", "state"]
        )
        fresh = registry.admissible()
        workers.add_metric([rid, "live"], len(fresh))
        workers.add_metric([rid, "stale"], len(registry.live) - len(fresh))
        workers.add_metric([rid, "dead"], len(registry.dead))
        yield workers
        yield self._peaks(registry.live.values())
        asks = CounterMetricFamily(
            "lightq:router_preempt_asks",
            "asks to a worker to pause worse-class requests for a request that fit nowhere (--preempt)",
            labels=["router"],
        )
        asks.add_metric([rid], router.preempter.num_asks if router.preempter is not None else 0)
        yield asks
        yield from self._ingress(router)
        yield from _shares(router)

    def _queue(self, router: Router, rid: str) -> Iterable[Metric]:
        queued = [request for _, request in _copy(router.queue)]
        values = router.rule.history.values
        mean_len = sum(values) / len(values) if values else None
        prompt = sum(r.num_prompt_tokens for r in queued)
        output = sum(
            min(r.params.max_new_tokens, round(mean_len))
            if mean_len and not r.params.ignore_eos
            else r.params.max_new_tokens
            for r in queued
        )
        yield _gauge(
            "lightq:router_queue_requests",
            "requests this router read and has not dispatched",
            ["router"],
            [([rid], len(queued))],
        )
        yield _gauge(
            "lightq:router_queue_tokens",
            "tokens of this router's queue: prompt, and predicted output (mean of its output-length history, capped)",
            ["router", "kind"],
            [([rid, "prompt"], prompt), ([rid, "predicted_output"], output)],
        )
        reserved = _copy(router.reservations.tokens().items())
        yield _gauge(
            "lightq:router_reserved_tokens",
            "tokens dispatched to a worker that its heartbeat does not show yet (prompt + max_new_tokens)",
            ["router", "worker"],
            [([rid, w], n) for w, n in reserved],
        )

    def _peaks(self, loads: Iterable[WorkerLoad]) -> Metric:
        family = GaugeMetricFamily(
            "lightq:worker_estimated_peak_ratio",
            "estimated peak KV use of the worker's batch (past-future quantile estimate) / its pool",
            labels=["worker"],
        )
        for load in loads:
            peak = self.router.rule.estimator.peak_quantile([ReqState(*state) for state in load.requests])
            family.add_metric([load.worker_id], peak / load.max_total_tokens if load.max_total_tokens else 0.0)
        return family

    def _ingress(self, router: Router) -> Iterable[Metric]:
        client = router.client
        lags, pendings = [], []  # one row per class's stream (shared.ingress)
        for _, stream in ingress.streams(client, router.keys):
            lag, pending = group_backlog(client, stream, ROUTER_GROUP)
            lags.append(([stream, ROUTER_GROUP], lag))
            pendings.append(([stream, ROUTER_GROUP], pending))
        yield _gauge("lightq:stream_lag", "entries never delivered to the group", ["stream", "group"], lags)
        yield _gauge("lightq:stream_pending", "entries delivered, not acknowledged", ["stream", "group"], pendings)
        yield _gauge(
            "lightq:dead_letters",
            "entries in the dead-letter stream",
            [],
            [([], client.xlen(router.keys.dead_letters()))],
        )


def _shares(router: Router) -> Iterable[Metric]:
    """The order's state in Redis (router.order.ordering), the same from every router: requests queued
    per class and per tenant, and tokens dispatched per tenant (prompt + max_new_tokens, what the
    fair share counts); per class ``--metrics_tenants`` tenants and ``other`` (``shared.tenant_series``)."""
    k = router.settings.metrics_tenants
    pipe = router.client.pipeline(transaction=False)
    pipe.hgetall(router.keys.tenant_queued())
    pipe.hgetall(router.keys.tenant_served())
    queued, served = ({split_class_tenant_field(k): int(v) for k, v in h.items()} for h in pipe.execute())
    per_class: dict[int, int] = {}
    for (priority, _), n in queued.items():
        per_class[priority] = per_class.get(priority, 0) + n
    yield _gauge(
        "lightq:queue_class_depth",
        "requests queued per priority class (read by a router, not yet dispatched)",
        ["priority"],
        [([str(p)], n) for p, n in sorted(per_class.items())],
    )
    yield _gauge(
        "lightq:queue_tenant_depth",
        "requests queued per priority class and tenant",
        ["priority", "tenant"],
        [([str(p), t], n) for (p, t), n in sorted(top_tenants(queued, k, sum_rest=True).items())],
    )
    family = CounterMetricFamily(
        "lightq:tenant_dispatched_tokens",
        "tokens dispatched per priority class and tenant (prompt + max_new_tokens per open sample); "
        "the --metrics_tenants tenants with the most, and other",
        labels=["priority", "tenant"],
    )
    for (p, t), n in sorted(top_tenants(served, k, sum_rest=False).items()):
        family.add_metric([str(p), t], n)
    yield family


def _gauge(name: str, doc: str, labels: list[str], values: list[tuple[list[str], float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for label_values, value in values:
        family.add_metric(label_values, value)
    return family
