"""Grammars compile off the model loop (worker.runner.grammar_cache, worker.runner.grammar): a worker
on the counting model, real Redis, and a compile function injected through ``GrammarCache`` that
waits on an Event, so a slow compile is slow for exactly as long as the test says. While it waits
the other requests decode; the held request waits in its place, counted as load, cancellable,
handed back by a drain, ended with an error when its constraint fails or times out, and runs under
its grammar once compiled. The same constraint sent twice compiles once."""

from __future__ import annotations

import re
import threading
from collections import Counter

import pytest
import torch
import xgrammar as xgr
from prometheus_client import generate_latest

from shared import ingress
from shared.admission import AdmissionRule
from shared.codec import entry, from_entry
from shared.config import AdmissionSettings, ModelSettings, WorkerSettings
from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.redis import ensure_group
from shared.schemas import Constraint, GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.monitoring.conftest import parse
from tests.worker.token_rows import flat
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Ended, Released, Started, Token
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.grammar import Grammars
from worker.runner.grammar_cache import GrammarCache, compile_constraint
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
SLOW_BAD = Constraint(kind="regex", spec="(abc")  # xgrammar refuses it (the producer would have)
FAST = Constraint(kind="regex", spec="[0-9]{2}")
WORKER = "gw"


class GatedCompile:
    """The compile function the cache runs on its threads: constraints in ``gated`` wait for
    ``release``; every call is counted per constraint."""

    def __init__(self, *gated: Constraint):
        self.gated = set(gated)
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls: Counter[Constraint] = Counter()

    def __call__(self, compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
        self.calls[constraint] += 1
        if constraint in self.gated:
            self.started.set()
            assert self.release.wait(30), "the test never released the compile"
        return compile_constraint(compiler, constraint)


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
def gate():
    gate = GatedCompile(SLOW, SLOW_BAD)
    yield gate
    gate.release.set()  # a compile still waiting ends (its thread is a daemon either way)


def make_worker(redis_settings, rclient, gate: GatedCompile, clock: Clock, timeout_s: float = 30.0):
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=WIDTH, stop_token_ids=[STOP])
    grammars = Grammars(GrammarCache(info, WIDTH, compile_fn=gate), compile_timeout_s=timeout_s, clock=clock)
    cpu = torch.device("cpu")
    runner = ModelRunner(
        CountingModel(WIDTH, cpu), TokenPool(POOL), ReqTable(8, POOL, POOL, cpu), WIDTH, cpu, {STOP}, grammars=grammars
    )
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


def test_others_decode_while_a_grammar_compiles_then_it_runs_under_its_grammar(redis_settings, rclient, keys, gate):
    service, out = make_worker(redis_settings, rclient, gate, Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "slow", SLOW)
    dispatch(rclient, keys, "after")  # behind the held one: it does not wait for it
    turns(service, 2)
    assert gate.started.wait(10)
    turns(service, 20)
    assert len(out.tokens("free")) >= 15 and len(out.tokens("after")) >= 15  # the loop never waited
    assert not out.of(Started, "slow") and not out.tokens("slow")
    assert [r.id for r in service.engine.waiting] == ["slow"]
    record = service.load(1)  # the router still sees it as this worker's load
    assert record.num_waiting == 1 and (4, 0, 200, 0) in [tuple(s) for s in record.requests]
    assert metric(service, "lightq:worker_grammar_waiting_requests") == 1

    gate.release.set()
    service.grammars.cache.wait(10)  # the compile ends on its thread
    turns(service, 1)
    assert out.of(Started, "slow") and {r.id for r in service.engine.running} == {"free", "after", "slow"}
    turns(service, 20)
    assert re.fullmatch(PATTERN, text(out.tokens("slow")))
    assert out.of(Released, "slow") and service.grammars.num_held == 0
    assert gate.calls[SLOW] == 1
    assert metric(service, "lightq:worker_grammar_compile_seconds_count") == 1
    assert metric(service, "lightq:worker_grammar_waiting_requests") == 0


def test_the_same_constraint_twice_while_it_compiles_compiles_once(redis_settings, rclient, keys, gate):
    service, out = make_worker(redis_settings, rclient, gate, Clock())
    dispatch(rclient, keys, "s1", SLOW)
    turns(service, 2)
    assert gate.started.wait(10)
    dispatch(rclient, keys, "s2", SLOW)
    dispatch(rclient, keys, "f1", FAST)  # another constraint compiles meanwhile, and runs
    turns(service, 10)
    assert re.fullmatch("[0-9]{2}", text(out.tokens("f1")))
    assert service.grammars.num_held == 2
    gate.release.set()
    service.grammars.cache.wait(10)
    turns(service, 20)
    assert text(out.tokens("s1")) == text(out.tokens("s2"))
    assert re.fullmatch(PATTERN, text(out.tokens("s1")))
    assert gate.calls == {SLOW: 1, FAST: 1}


def test_a_constraint_that_fails_to_compile_ends_its_request_alone(redis_settings, rclient, keys, gate):
    service, out = make_worker(redis_settings, rclient, gate, Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "bad", SLOW_BAD)
    turns(service, 2)
    assert gate.started.wait(10)
    gate.release.set()
    service.grammars.cache.wait(10)
    turns(service, 2)
    (ended,) = out.of(Ended, "bad")
    assert (ended.status, ended.reason) == (RequestStatus.FAILED, "error")
    assert ended.error.startswith("invalid regex constraint")
    assert out.of(Released, "bad") and not out.of(Started, "bad")
    assert [r.id for r in service.engine.running] == ["free"] and not service.engine.waiting
    assert metric(service, "lightq:worker_grammar_failures_total") == 1
    before = len(out.tokens("free"))
    turns(service, 3)
    assert len(out.tokens("free")) == before + 3


def test_a_compile_past_the_timeout_ends_its_request_and_is_kept_when_it_ends(redis_settings, rclient, keys, gate):
    clock = Clock()
    service, out = make_worker(redis_settings, rclient, gate, clock, timeout_s=5.0)
    dispatch(rclient, keys, "late", SLOW)
    turns(service, 2)
    assert gate.started.wait(10)
    clock.now = 4.0
    turns(service, 1)
    assert not out.of(Ended, "late")
    clock.now = 6.0
    turns(service, 1)
    (ended,) = out.of(Ended, "late")
    assert ended.status == RequestStatus.FAILED and ended.error == "regex constraint not compiled within 5 s"
    assert out.of(Released, "late") and not service.engine.has_work
    gate.release.set()  # the compile ran on: its grammar is kept for the next request
    service.grammars.cache.wait(10)
    dispatch(rclient, keys, "again", SLOW)
    turns(service, 20)
    assert re.fullmatch(PATTERN, text(out.tokens("again")))
    assert gate.calls[SLOW] == 1


def test_a_held_request_is_cancelled(redis_settings, rclient, keys, gate):
    service, out = make_worker(redis_settings, rclient, gate, Clock())
    dispatch(rclient, keys, "free")
    dispatch(rclient, keys, "slow", SLOW)
    turns(service, 2)
    assert gate.started.wait(10)
    rclient.set(keys.cancel("slow"), 1)
    service._next_cancel_check = 0.0  # the next turn checks cancels (every 50 ms)
    turns(service, 2)
    (ended,) = out.of(Ended, "slow")
    assert ended.status == RequestStatus.CANCELLED and out.of(Released, "slow")
    assert [r.id for r in service.engine.requests()] == ["free"] and service.grammars.num_held == 0


def test_a_drain_hands_a_held_request_back(redis_settings, rclient, keys, gate):
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    service, out = make_worker(redis_settings, rclient, gate, Clock())
    dispatch(rclient, keys, "free", max_new=1000)
    dispatch(rclient, keys, "slow", SLOW)
    turns(service, 2)
    assert gate.started.wait(10)
    service._drain()  # "free" runs on for drain_timeout; "slow" never started: back to the queue at once
    assert [from_entry(GenerateRequest, f).id for _, f in ingress.entries(rclient, keys)] == ["slow"]
    assert [from_entry(GenerateRequest, f).id for _, f in rclient.xrange(keys.inbox(WORKER))] == ["free"]
    assert rclient.hget(keys.meta("slow"), "status") == "queued"
    assert not service.engine.waiting and not out.of(Ended, "slow")
    service._end_failed_grammars(service.grammars)
    assert service.grammars.num_held == 0
