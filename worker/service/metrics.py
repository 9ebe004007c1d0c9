"""The worker's Prometheus endpoint (``--metrics_port``): its batch, pool and tokens.

Gauges are read when scraped, on the HTTP server's thread, from the
engine's public state (``snapshot()``, ``limits``, ``requests()``: the same
reads the heartbeat thread makes) and from Redis (the inbox group).
Counters come from ``MeteredService``, the service loop with its
``on_step`` hook counting each engine step's events and timing the step
(as ``router.metrics.MeteredRouter`` counts the router's steps).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shared.keys import WORKER_GROUP, Keys
from shared.redis import group_backlog
from shared.request_log import now_ms
from worker.engine.engine import Engine
from worker.engine.events import Ended, Event, Started, Tokens
from worker.engine.kv_slots import CacheStats
from worker.engine.load import LoadSnapshot
from worker.service.serve import WorkerService

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class WorkerMetrics:
    def __init__(self, worker_id: str):
        # No collect() at registration: a collector reads Redis, which may be down at start-up.
        self.registry = CollectorRegistry(auto_describe=False)
        reg, worker = self.registry, worker_id
        self.generation_tokens = _worker_counter(
            reg, worker, "lightq:worker_generation_tokens", "output tokens sampled"
        )
        self.prompt_tokens = _worker_counter(
            reg, worker, "lightq:worker_prompt_tokens", "tokens prefilled (prompt + resumed output)"
        )
        self.ended = Counter(
            "lightq:worker_requests_ended",
            "requests that ended here, by finish reason",
            ["worker", "reason"],
            registry=reg,
        )
        self.step_time = _worker_histogram(
            reg, worker, "lightq:worker_step_seconds", "one engine step (prefill chunk + decode)", STEP_BUCKETS
        )
        self.queue_time = _worker_histogram(
            reg,
            worker,
            "lightq:worker_queue_seconds",
            "from a request's creation at the producer "
            "to its admission into this worker's batch (the clocks of two hosts)",
            QUEUE_BUCKETS,
        )
        self.batch_size = _worker_histogram(
            reg, worker, "lightq:worker_batch_requests", "requests in the running batch after a step", BATCH_BUCKETS
        )
        self.grammar_compile_time = _worker_histogram(
            reg,
            worker,
            "lightq:worker_grammar_compile_seconds",
            "one constraint's grammar compile (off the model loop; a constraint already cached is not compiled)",
            COMPILE_BUCKETS,
        )
        self.grammar_failures = _worker_counter(
            reg,
            worker,
            "lightq:worker_grammar_failures",
            "requests ended because their constraint failed to compile or timed out (--grammar_compile_timeout_s)",
        )
        self.worker_id = worker_id

    def count(self, events: list[Event], now_ms: int) -> None:
        for event in events:
            if isinstance(event, Tokens):
                self.generation_tokens.inc(len(event))
                for reason in event.reasons.values():
                    self.ended.labels(worker=self.worker_id, reason=reason).inc()
            elif isinstance(event, Started):
                # what its prefill feeds: the prompt once, then each sample's resumed tokens
                msg = event.msg
                self.queue_time.observe(max(0, now_ms - msg.created_ms) / 1000)
                self.prompt_tokens.inc(len(msg.prompt_ids) + sum(len(msg.emitted(c)) for c in msg.open_choices))
            elif isinstance(event, Ended):
                self.ended.labels(worker=self.worker_id, reason=event.reason).inc()


def _worker_counter(registry: CollectorRegistry, worker_id: str, name: str, doc: str) -> Counter:
    """A counter in ``registry``, labelled with this worker's id."""
    return Counter(name, doc, ["worker"], registry=registry).labels(worker=worker_id)


def _worker_histogram(
    registry: CollectorRegistry, worker_id: str, name: str, doc: str, buckets: tuple[float, ...]
) -> Histogram:
    """A histogram in ``registry``, labelled with this worker's id."""
    return Histogram(name, doc, ["worker"], buckets=buckets, registry=registry).labels(worker=worker_id)


class MeteredService(WorkerService):
    """The worker's service loop with its engine steps timed and their events counted; behaviour
    unchanged."""

    def __init__(self, *args, metrics: WorkerMetrics, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics = metrics

    def on_step(self, events: list[Event], seconds: float) -> None:
        self.metrics.step_time.observe(seconds)
        self.metrics.batch_size.observe(len(self.engine.running))
        self.metrics.count(events, now_ms())

    def on_grammars(self, compile_seconds: list[float], num_failed: int) -> None:
        for seconds in compile_seconds:
            self.metrics.grammar_compile_time.observe(seconds)
        self.metrics.grammar_failures.inc(num_failed)


class WorkerCollector(Collector):
    def __init__(self, engine: Engine, client: redis.Redis, keys: Keys, worker_id: str):
        self.engine = engine
        self.client = client
        self.keys = keys
        self.worker_id = worker_id

    def collect(self) -> Iterable[Metric]:
        snap, limits, w = self.engine.snapshot(), self.engine.limits, [self.worker_id]
        pool = limits.max_total_tokens
        yield from self._batch(snap, w)
        yield from _kv_pool(snap, pool, w)
        yield from self._preemptions(w)
        yield from _prefix_cache(snap.cache, w)
        adapters = getattr(self.engine.runner, "adapters", None)  # worker.lora.adapter_set.AdapterSet, or None
        yield _counter(
            "lightq:worker_lora_loads",
            "LoRA adapters loaded at run time copied into a device slot (--max_loras), on loading or when a "
            "request needed one that was not there (evicting the least recently used): adapter-aware routing "
            "keeps this low",
            w,
            adapters.loads if adapters is not None else 0,
        )
        yield from self._inbox()

    def _batch(self, snap: LoadSnapshot, w: list[str]) -> Iterable[Metric]:
        """The running batch and the requests waiting to join it."""
        yield _gauge("lightq:worker_running_requests", "requests in the running batch", w, snap.num_running)
        yield _gauge(
            "lightq:worker_waiting_requests", "requests taken in, not yet admitted to the batch", w, snap.num_waiting
        )
        grammars = getattr(self.engine.runner, "grammars", None)  # worker.runner.grammar.Grammars or None
        yield _gauge(
            "lightq:worker_grammar_waiting_requests",
            "waiting requests held until their grammar compiles (counted in waiting_requests too)",
            w,
            grammars.num_held if grammars is not None else 0,
        )

    def _preemptions(self, w: list[str]) -> Iterable[Metric]:
        """Requests paused and tokens thrown away since the worker started."""
        yield _counter(
            "lightq:worker_preemptions",
            "running requests paused to free KV slots (an estimate was short; each is prefilled again later)",
            w,
            self.engine.num_pauses,
        )
        yield _counter(
            "lightq:worker_priority_preemptions",
            "started requests paused for a better priority class (router --preempt) and handed back to the queue",
            w,
            self.engine.num_preempted,
        )
        yield _counter(
            "lightq:worker_preempted_kv_tokens",
            "K/V tokens those pauses threw away: prefilled again where the requests resume (their cost)",
            w,
            self.engine.num_preempted_tokens,
        )
        yield _counter(
            "lightq:worker_overlap_discarded_tokens",
            "tokens sampled for requests that had ended by the time they landed (--overlap finds an EOS, "
            "grammar or stop-string end one step late; each cost one token of compute, none was published)",
            w,
            self.engine.num_discarded,
        )

    def _inbox(self) -> Iterable[Metric]:
        stream = self.keys.inbox(self.worker_id)
        lag, pending = group_backlog(self.client, stream, WORKER_GROUP)
        labels = ["stream", "group"]
        yield _gauge("lightq:stream_lag", "entries never delivered to the group", [stream, WORKER_GROUP], lag, labels)
        yield _gauge(
            "lightq:stream_pending", "entries delivered, not acknowledged", [stream, WORKER_GROUP], pending, labels
        )


def _kv_pool(snap: LoadSnapshot, pool: int, w: list[str]) -> Iterable[Metric]:
    """The KV pool (``pool`` tokens): what requests hold and have committed, and the share in use."""
    yield _gauge("lightq:worker_used_tokens", "KV pool tokens holding a request's K/V", w, snap.used_tokens)
    yield _gauge(
        "lightq:worker_committed_tokens",
        "prompt + max_new_tokens over running and waiting requests",
        w,
        snap.committed_tokens,
    )
    yield _gauge("lightq:worker_max_total_tokens", "KV pool size in tokens", w, pool)
    yield _gauge(
        "lightq:worker_kv_usage_ratio",
        "KV pool tokens in use / pool size",
        w,
        snap.used_tokens / pool if pool else 0.0,
    )


def _prefix_cache(cache: CacheStats, w: list[str]) -> Iterable[Metric]:
    """The prefix cache (``--prefix_cache``; all 0 when off)."""
    yield _gauge(
        "lightq:worker_prefix_cached_tokens",
        "KV pool tokens the prefix cache holds (leased or evictable)",
        w,
        cache.cached,
    )
    yield _gauge(
        "lightq:worker_prefix_evictable_tokens",
        "cached tokens no running request holds: free for admission, evicted when the pool needs them",
        w,
        cache.evictable,
    )
    yield _counter(
        "lightq:worker_prefix_asked_tokens",
        "tokens of admitted requests looked up in the prefix cache (prompt + resumed output)",
        w,
        cache.asked,
    )
    yield _counter(
        "lightq:worker_prefix_hit_tokens", "of the tokens looked up, those found cached (not prefilled)", w, cache.hit
    )
    yield _gauge(
        "lightq:worker_prefix_hit_ratio",
        "hit tokens / looked-up tokens since the worker started",
        w,
        cache.hit / cache.asked if cache.asked else 0.0,
    )
    yield _counter(
        "lightq:worker_prefix_evicted_tokens",
        "cached tokens evicted to make room since the worker started",
        w,
        cache.evicted,
    )


def _gauge(name: str, doc: str, label_values: list[str], value: float, labels: list[str] | None = None) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=labels or ["worker"])
    family.add_metric(label_values, value)
    return family


def _counter(name: str, doc: str, label_values: list[str], value: float) -> Metric:
    family = CounterMetricFamily(name, doc, labels=["worker"])
    family.add_metric(label_values, value)
    return family
