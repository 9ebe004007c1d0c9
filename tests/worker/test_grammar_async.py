"""Grammars compile off the model loop (worker.runner.grammar_cache, compile_pool, grammar): a worker
on the counting model, real Redis, real compile processes, and a compile function that holds chosen
constraints at a gate (tests/worker/grammar_gate.py), so a slow compile is slow for exactly as long
as the test says. While it waits the other requests decode; the held request waits in its place,
counted as load, cancellable, handed back by a drain, ended with an error when its constraint fails
or times out (the compile then stopped), and runs under its grammar once compiled. The same
constraint sent twice compiles once (the pool's count of compiles it started), and a cheap compile
never waits behind slow ones."""

from __future__ import annotations

import re
import time

import pytest
import torch
import xgrammar as xgr
from prometheus_client import generate_latest

from shared import ingress
from shared.admission import AdmissionRule
from shared.codec import entry, from_entry
from shared.config import AdmissionSettings, ModelSettings
from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.redis import ensure_group
from shared.schemas import Constraint, GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.monitoring.conftest import parse
from tests.worker.grammar_gate import CRASH, Gate, wait_gone
from tests.worker.token_rows import flat
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Ended, Released, Started, Token
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.grammar import Grammars
from worker.runner.grammar_cache import GrammarCache
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable
from worker.service.metrics import MeteredService, WorkerCollector, WorkerMetrics

WIDTH = 256  # the counting model's vocabulary, and the grammar's
POOL = 4096
# A tokenizer-free vocabulary: printable characters, a few longer pieces, a stop token.
PIECES = [chr(c) for c in range(32, 127)] + ['{"', '":', "yes", "no", "ab"]
VOCAB = [*PIECES, "</s>"]
STOP = len(VOCAB) - 1
PATTERN = "(yes|no)-[a-c]{3}"
SLOW = Constraint(kind="regex", spec=PATTERN)
SLOW_TOO = Constraint(kind="regex", spec="(ab|no)-[0-9]{2}")
SLOW_BAD = Constraint(kind="regex", spec="(abc")  # xgrammar refuses it (the producer would have)
FAST = Constraint(kind="regex", spec="[0-9]{2}")
WORKER = "gw"


class Recorder:
    """The part of ``PublisherLink`` the service uses: keeps the events."""

    def __init__(self):
        self.events: list = []

    def put(self, events) -> None:
        self.events += flat(events)

    def take_stopped(self) -> list:
        return []

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass

    def tokens(self, request_id: str) -> list[Token]:
        return [e for e in self.events if isinstance(e, Token) and e.request_id == request_id]

    def of(self, kind: type, request_id: str) -> list:
        return [e for e in self.events if isinstance(e, kind) and e.request_id == request_id]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def gate(tmp_path):
    gate = Gate(tmp_path, SLOW, SLOW_TOO, SLOW_BAD)
    yield gate
    gate.release()  # a compile still held ends (the pool is closed with its worker)


@pytest.fixture
def make_worker(redis_settings, rclient, gate):
    """A worker of its own per call, its compile processes stopped after the test."""
    caches = []

    def make(clock, timeout_s: float = 30.0, slow_after_s: float = 30.0):
        # slow_after_s: long unless a test is about the lanes, so a loaded machine's cheap compile is
        # never taken for a slow one
        info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=WIDTH, stop_token_ids=[STOP])
        cache = GrammarCache(info, WIDTH, compile_fn=gate.compile_fn, slow_after_s=slow_after_s)
        caches.append(cache)
        grammars = Grammars(cache, compile_timeout_s=timeout_s, clock=clock)
        cpu = torch.device("cpu")
        runner = ModelRunner(
            CountingModel(WIDTH, cpu), TokenPool(POOL), ReqTable(8, POOL, POOL, cpu), WIDTH, cpu, {STOP},
            grammars=grammars,
        )  # fmt: skip
        engine = Engine(
            runner, EngineLimits(POOL, 1024, 8), {STOP}, AdmissionRule(AdmissionSettings(admission="conservative"))
        )
        settings = WorkerSettings(redis=redis_settings, model=ModelSettings(model_dir="counting"), drain_timeout=0.2)
        ensure_group(rclient, settings.redis.keys.inbox(WORKER), WORKER_GROUP)
        metrics = WorkerMetrics(WORKER)
        metrics.registry.register(WorkerCollector(engine, rclient, settings.redis.keys, WORKER))
        publisher = Recorder()
        service = MeteredService(settings, rclient, engine, WORKER, publisher, metrics=metrics)  # type: ignore[arg-type]
        return service, publisher

    yield make
    for cache in caches:
        cache.close()


def dispatch(rclient, keys, request_id: str, constraint: Constraint | None = None, max_new: int = 200) -> None:
    params = SamplingParams(max_new_tokens=max_new, constraint=constraint, ignore_eos=constraint is None)
    msg = GenerateRequest(id=request_id, prompt_ids=[3] * 4, params=params, created_ms=0)
    rclient.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=0))
    rclient.xadd(keys.inbox(WORKER), entry(msg))


def turns(service, n: int) -> None:
    for _ in range(n):
        service._serve_once()


def text(tokens: list[Token]) -> str:
    """The output before its stop token (the grammar's end)."""
    assert tokens[-1].token_id == STOP and tokens[-1].finish_reason == "stop"
    return "".join(VOCAB[t.token_id] for t in tokens[:-1])


def metric(service, name: str) -> float:
    return parse(generate_latest(service.metrics.registry).decode())[(name, (("worker", WORKER),))]


def run_until(service, done, limit_s: float = 60.0) -> None:
    """Loop turns until ``done()``; fails after ``limit_s`` (what it waits for never came)."""
    deadline = time.monotonic() + limit_s
    while not done():
        assert time.monotonic() < deadline, "what the test waited for never came"
        service._serve_once()


def test_others_decode_while_a_grammar_compiles_then_it_runs_under_its_grammar(make_worker, rclient, keys, gate):
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "slow", SLOW)
    dispatch(rclient, keys, "after")  # behind the held one: it does not wait for it
    turns(service, 2)
    gate.wait_started(1)
    turns(service, 20)
    assert len(out.tokens("free")) >= 15 and len(out.tokens("after")) >= 15  # the loop never waited
    assert not out.of(Started, "slow") and not out.tokens("slow")
    assert [r.id for r in service.engine.waiting] == ["slow"]
    record = service.load(1)  # the router still sees it as this worker's load
    assert record.num_waiting == 1 and (4, 0, 200, 0) in [tuple(s) for s in record.requests]
    assert metric(service, "lightq:worker_grammar_waiting_requests") == 1

    gate.release()
    service.grammars.cache.wait(30)  # the compile ends in its process
    turns(service, 1)
    assert out.of(Started, "slow") and {r.id for r in service.engine.running} == {"free", "after", "slow"}
    turns(service, 20)
    assert re.fullmatch(PATTERN, text(out.tokens("slow")))
    assert out.of(Released, "slow") and service.grammars.num_held == 0
    assert service.grammars.cache.pool.started[SLOW] == 1
    assert metric(service, "lightq:worker_grammar_compile_seconds_count") == 1
    assert metric(service, "lightq:worker_grammar_waiting_requests") == 0


def test_the_same_constraint_twice_while_it_compiles_compiles_once(make_worker, rclient, keys, gate):
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "s1", SLOW)
    turns(service, 2)
    gate.wait_started(1)
    dispatch(rclient, keys, "s2", SLOW)
    dispatch(rclient, keys, "f1", FAST)  # another constraint compiles meanwhile, and runs
    run_until(service, lambda: out.of(Released, "f1"))
    assert re.fullmatch("[0-9]{2}", text(out.tokens("f1")))
    assert service.grammars.num_held == 2
    gate.release()
    service.grammars.cache.wait(30)
    turns(service, 20)
    assert text(out.tokens("s1")) == text(out.tokens("s2"))
    assert re.fullmatch(PATTERN, text(out.tokens("s1")))
    assert service.grammars.cache.pool.started == {SLOW: 1, FAST: 1}  # real compiles, counted as started


def test_a_cheap_compile_never_waits_behind_slow_ones(make_worker, rclient, keys, gate):
    """Two compiles held at the gate (as slow as the test likes) on a pool of two processes: the
    younger is stopped once both are slow (slow_after_s), so a cheap one still compiles and runs;
    released, the stopped one compiles again from the start and runs too."""
    service, out = make_worker(Clock(), slow_after_s=0.2)
    dispatch(rclient, keys, "slow", SLOW)
    dispatch(rclient, keys, "slow_too", SLOW_TOO)
    turns(service, 2)
    gate.wait_started(1)  # the other may be stopped before it reaches the gate
    dispatch(rclient, keys, "cheap", FAST)
    run_until(service, lambda: out.of(Released, "cheap"))
    assert re.fullmatch("[0-9]{2}", text(out.tokens("cheap")))
    assert service.grammars.num_held == 2  # both slow ones still held: one at the gate, one stopped
    gate.release()
    run_until(service, lambda: out.of(Released, "slow") and out.of(Released, "slow_too"))
    assert re.fullmatch(PATTERN, text(out.tokens("slow")))
    assert re.fullmatch("(ab|no)-[0-9]{2}", text(out.tokens("slow_too")))
    started = service.grammars.cache.pool.started
    assert started[FAST] == 1 and sorted([started[SLOW], started[SLOW_TOO]]) == [1, 2]


def test_a_constraint_that_fails_to_compile_ends_its_request_alone(make_worker, rclient, keys, gate):
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "bad", SLOW_BAD)
    turns(service, 2)
    gate.wait_started(1)
    gate.release()
    run_until(service, lambda: out.of(Ended, "bad"))
    (ended,) = out.of(Ended, "bad")
    assert (ended.status, ended.reason) == (RequestStatus.FAILED, "error")
    assert ended.error.startswith("invalid_constraint: the regex constraint: ")
    assert Constraint.error_code(ended.error) == Constraint.INVALID  # the producer's 400
    assert out.of(Released, "bad") and not out.of(Started, "bad")
    assert [r.id for r in service.engine.running] == ["free"] and not service.engine.waiting
    assert metric(service, "lightq:worker_grammar_failures_total") == 1
    before = len(out.tokens("free"))
    turns(service, 3)
    assert len(out.tokens("free")) == before + 3


def test_a_compile_that_ends_its_process_fails_its_request_alone(make_worker, rclient, keys, gate):
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "crash", CRASH)
    run_until(service, lambda: out.of(Ended, "crash"))
    (ended,) = out.of(Ended, "crash")
    assert ended.error == "invalid_constraint: the regex constraint: its compile ended the compiling process (3)"
    dispatch(rclient, keys, "after", FAST)  # the pool started another process
    run_until(service, lambda: out.of(Released, "after"))
    assert re.fullmatch("[0-9]{2}", text(out.tokens("after")))


def test_a_compile_past_the_timeout_ends_its_request_and_is_stopped(make_worker, rclient, keys, gate):
    clock = Clock()
    service, out = make_worker(clock, timeout_s=5.0)
    dispatch(rclient, keys, "late", SLOW)
    turns(service, 2)
    (pid,) = gate.wait_started(1)
    clock.now = 4.0
    turns(service, 1)
    assert not out.of(Ended, "late")
    clock.now = 6.0
    turns(service, 1)
    (ended,) = out.of(Ended, "late")
    assert ended.status == RequestStatus.FAILED and ended.error.startswith(
        "constraint_too_costly: the regex constraint was not compiled within 5 s"
    )
    assert Constraint.error_code(ended.error) == Constraint.TOO_COSTLY  # the producer's 400
    assert out.of(Released, "late") and not service.engine.has_work
    wait_gone(pid)  # nobody waits for it: its process was killed, freeing the lane
    gate.release()
    dispatch(rclient, keys, "again", SLOW)  # compiles anew
    run_until(service, lambda: out.of(Released, "again"))
    assert re.fullmatch(PATTERN, text(out.tokens("again")))
    assert service.grammars.cache.pool.started[SLOW] == 2


def test_a_held_request_is_cancelled(make_worker, rclient, keys, gate):
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "slow", SLOW)
    turns(service, 2)
    gate.wait_started(1)
    rclient.set(keys.cancel("slow"), 1)
    service.intake.next_cancels = 0.0  # the next turn checks cancels (every 50 ms)
    turns(service, 2)
    (ended,) = out.of(Ended, "slow")
    assert ended.status == RequestStatus.CANCELLED and out.of(Released, "slow")
    assert [r.id for r in service.engine.requests()] == ["free"] and service.grammars.num_held == 0


def test_a_drain_hands_a_held_request_back(make_worker, rclient, keys, gate):
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    service, out = make_worker(Clock())
    dispatch(rclient, keys, "free", max_new=1000)
    dispatch(rclient, keys, "slow", SLOW)
    turns(service, 2)
    gate.wait_started(1)
    service._drain()  # "free" runs on for drain_timeout; "slow" never started: back to the queue at once
    assert [from_entry(GenerateRequest, f).id for _, f in ingress.entries(rclient, keys)] == ["slow"]
    assert [from_entry(GenerateRequest, f).id for _, f in rclient.xrange(keys.inbox(WORKER))] == ["free"]
    assert rclient.hget(keys.meta("slow"), "status") == "queued"
    assert not service.engine.waiting and not out.of(Ended, "slow")
    service._end_failed_grammars(service.grammars)
    assert service.grammars.num_held == 0
