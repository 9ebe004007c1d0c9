"""The router's and the worker's own endpoints (``--metrics_port``) against a real Redis."""

from __future__ import annotations

import socket

import httpx
from prometheus_client import CollectorRegistry, generate_latest

from router.metrics import MeteredRouter, RouterCollector, RouterMetrics
from shared.config import AdmissionSettings, RouterSettings
from shared.embedded_redis import free_port
from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.metrics_server import serve_metrics as serve_router_metrics
from shared.metrics_server import serve_metrics as serve_worker_metrics
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.monitoring.conftest import parse
from tests.router.helpers import publish_load, submit
from tests.worker.token_rows import pack
from worker.engine.engine import EngineLimits, LoadSnapshot
from worker.engine.events import Ended, Started, Token
from worker.engine.kv_slots import CacheStats
from worker.service.metrics import MeteredService, WorkerCollector, WorkerMetrics


def samples(registry: CollectorRegistry) -> dict:
    return parse(generate_latest(registry).decode())


def metered_router(redis_settings, rclient) -> MeteredRouter:
    metrics = RouterMetrics("r1")
    router = MeteredRouter(
        RouterSettings(redis=redis_settings, poll_ms=10, admission_rule=AdmissionSettings(admission="conservative")),
        rclient,
        "r1",
        metrics=metrics,
    )
    metrics.registry.register(RouterCollector(router))
    ensure_group(rclient, router.keys.requests(), ROUTER_GROUP)
    return router


def test_router_counts_dispatches_and_pauses_and_reports_its_queue(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=100, requests=[(30, 0, 20, 1)])
    router = metered_router(redis_settings, rclient)
    submit(rclient, keys, "q0", 10, 10)
    submit(rclient, keys, "big", 40, 40)  # 80 > the 50 left after q0: waits at the head
    submit(rclient, keys, "q2", 5, 5)
    router.step()
    router.step()
    s, r1 = samples(router.metrics.registry), (("router", "r1"),)
    assert s[("lightq:router_dispatches_total", r1)] == 1
    assert s[("lightq:router_pauses_total", r1)] == 1
    assert s[("lightq:router_decisions_total", (("reason", "least_loaded"), ("router", "r1")))] == 1
    assert s[("lightq:router_decisions_total", (("reason", "wait"), ("router", "r1")))] >= 1  # asked each pass
    assert s[("lightq:router_dispatch_step_seconds_count", r1)] == 1
    assert s[("lightq:router_queue_requests", r1)] == 2
    assert s[("lightq:router_queue_tokens", (("kind", "prompt"), ("router", "r1")))] == 45
    assert s[("lightq:router_reserved_tokens", (("router", "r1"), ("worker", "w1")))] == 20
    assert s[("lightq:router_workers", (("router", "r1"), ("state", "live")))] == 1
    # The worker's own batch, ignore_eos: 30 held + 20 to come at the peak.
    assert s[("lightq:worker_estimated_peak_ratio", (("worker", "w1"),))] == 0.5
    ingress = (("group", ROUTER_GROUP), ("stream", keys.requests()))
    assert s[("lightq:stream_pending", ingress)] == 2 and s[("lightq:stream_lag", ingress)] == 0
    assert s[("lightq:dead_letters", ())] == 0


def test_router_adds_its_decisions_in_redis_for_the_dashboard(redis_settings, rclient, keys):
    """At most a flush a second: the first step's decisions at once, the next ones a second later."""
    publish_load(rclient, keys, "w1", max_total=100)
    router = metered_router(redis_settings, rclient)
    submit(rclient, keys, "q0", 10, 10)
    router.step()
    assert rclient.hgetall(keys.router_decisions()) == {"least_loaded": "1"}
    submit(rclient, keys, "q1", 10, 10)
    router.step()
    assert rclient.hgetall(keys.router_decisions()) == {"least_loaded": "1"}  # kept until the next flush
    router._next_flush = 0.0  # a second later
    router.step()
    assert rclient.hgetall(keys.router_decisions()) == {"least_loaded": "2"}
    counted = samples(router.metrics.registry)[
        ("lightq:router_decisions_total", (("reason", "least_loaded"), ("router", "r1")))
    ]
    assert counted == 2


class StubEngine:
    """What the collector and the service loop read of ``worker.engine.engine.Engine``."""

    limits = EngineLimits(max_total_tokens=1000, batch_max_tokens=64, running_max_req_size=8)
    runner = None  # no grammars: this worker refuses constrained requests
    has_work = True
    running = [object()] * 3  # the batch after the step
    num_pauses = 2
    num_preempted, num_preempted_tokens = 1, 57  # paused for a better class (router --preempt)
    num_discarded = 4  # --overlap: sampled for requests already ended

    def __init__(self, events):
        self.events = events

    def snapshot(self) -> LoadSnapshot:
        cache = CacheStats(cached=300, evictable=100, asked=1000, hit=250, evicted=40)
        return LoadSnapshot(used_tokens=400, committed_tokens=600, num_running=2, num_waiting=5, cache=cache)

    def step(self, early):
        early(self.events[:1])  # the prefill's events go out before the decode runs
        return self.events[1:]


class StubPublisher:
    def __init__(self):
        self.events = []

    def put(self, events):
        self.events += events

    def take_stopped(self):
        return []


def test_worker_counts_tokens_and_reads_its_engine(redis_settings, rclient, keys):
    created = now_ms() - 1500  # queued 1.5 s before its admission here
    events = [
        Started(
            GenerateRequest(
                id="a",
                prompt_ids=[1, 2, 3],
                resume_ids=[7],
                created_ms=created,
                params=SamplingParams(max_new_tokens=4),
            )
        ),
        pack([Token("a", 1, 9, -0.1, None), Token("b", 4, 9, -0.1, "length")]),
        Ended("c", "cancelled", "cancelled", 2),
    ]
    metrics, engine = WorkerMetrics("w1"), StubEngine(events)
    metrics.registry.register(WorkerCollector(engine, rclient, keys, "w1"))
    service = MeteredService(
        WorkerSettings(redis=redis_settings), rclient, engine, "w1", StubPublisher(), metrics=metrics
    )
    service._step()
    assert service.publisher.events == events
    ensure_group(rclient, keys.inbox("w1"), WORKER_GROUP)
    rclient.xadd(keys.inbox("w1"), {"msg": "x"})
    s, w1 = samples(metrics.registry), (("worker", "w1"),)
    assert s[("lightq:worker_generation_tokens_total", w1)] == 2
    assert s[("lightq:worker_prompt_tokens_total", w1)] == 4
    assert s[("lightq:worker_requests_ended_total", (("reason", "length"), ("worker", "w1")))] == 1
    assert s[("lightq:worker_requests_ended_total", (("reason", "cancelled"), ("worker", "w1")))] == 1
    assert s[("lightq:worker_step_seconds_count", w1)] == 1
    assert s[("lightq:worker_queue_seconds_count", w1)] == 1
    assert 1.5 <= s[("lightq:worker_queue_seconds_sum", w1)] < 60
    assert s[("lightq:worker_queue_seconds_bucket", (("le", "1.0"), ("worker", "w1")))] == 0
    assert s[("lightq:worker_batch_requests_sum", w1)] == 3
    assert s[("lightq:worker_batch_requests_bucket", (("le", "2.0"), ("worker", "w1")))] == 0
    assert s[("lightq:worker_preemptions_total", w1)] == 2
    assert s[("lightq:worker_priority_preemptions_total", w1)] == 1
    assert s[("lightq:worker_preempted_kv_tokens_total", w1)] == 57
    assert s[("lightq:worker_overlap_discarded_tokens_total", w1)] == 4
    assert s[("lightq:worker_kv_usage_ratio", w1)] == 0.4
    assert (s[("lightq:worker_prefix_cached_tokens", w1)], s[("lightq:worker_prefix_evictable_tokens", w1)]) == (
        300,
        100,
    )
    assert s[("lightq:worker_prefix_hit_tokens_total", w1)] == 250
    assert s[("lightq:worker_prefix_asked_tokens_total", w1)] == 1000
    assert s[("lightq:worker_prefix_hit_ratio", w1)] == 0.25
    assert s[("lightq:worker_prefix_evicted_tokens_total", w1)] == 40
    assert (s[("lightq:worker_running_requests", w1)], s[("lightq:worker_waiting_requests", w1)]) == (2, 5)
    assert s[("lightq:stream_lag", (("group", WORKER_GROUP), ("stream", keys.inbox("w1"))))] == 1


def test_metrics_port_zero_is_off_and_a_taken_port_moves_up():
    registry = CollectorRegistry()
    assert serve_router_metrics(registry, 0) is None and serve_worker_metrics(registry, 0) is None
    port = free_port()
    taken = socket.socket()
    taken.bind(("0.0.0.0", port))
    taken.listen()
    server = serve_worker_metrics(registry, port)
    try:
        assert server.server_port > port
        assert httpx.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=5).status_code == 200
    finally:
        server.shutdown()
        taken.close()
