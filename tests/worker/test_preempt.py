"""Preempt and resume on the worker (issue 19, real Redis, counting model, publisher in-process):
asked by a router, a worker pauses the newest request of the worst class, hands it back to the
queue after its tokens, and the worker that resumes it ends with each index once, token-identical
to an uninterrupted run; the bound on preemptions holds; the load record lists what may be paused."""

from __future__ import annotations

import pytest
import torch

from shared import ingress
from shared.admission import AdmissionRule, request_states
from shared.chunk_schemas import TokenChunk
from shared.chunks import parse_run
from shared.codec import encode, entry, from_entry
from shared.config import AdmissionSettings, ModelSettings
from shared.keys import ROUTER_GROUP, WORKER_GROUP
from shared.model_files import load_tokenizer, resolve
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_load import PreemptAsk
from shared.worker_settings import WorkerSettings
from worker.engine.engine import Engine, EngineLimits
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable
from worker.service.publisher import Publisher
from worker.service.serve import WorkerService

POOL = 100  # two requests of 8 + 30 tokens fit (conservative), a third does not
MAX_NEW = 30


class InlineLink:
    """The part of ``PublisherLink`` the service uses, publishing in this process."""

    def __init__(self, publisher: Publisher):
        self.publisher = publisher

    def put(self, events) -> None:
        if events:
            self.publisher.record([(now_ms(), events)])
            self.publisher.flush(everything=True)

    def take_stopped(self) -> list:
        return []

    def check(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve("counting"))


def make_worker(
    redis_settings, rclient, tokenizer, worker_id: str, max_preemptions: int = 2, preempt: bool = False
) -> WorkerService:
    cpu = torch.device("cpu")
    runner = ModelRunner(CountingModel(256, cpu), TokenPool(POOL), ReqTable(4, 64, POOL, cpu), 256, cpu, set(), None)
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    engine = Engine(runner, EngineLimits(POOL, 64, 4), set(), rule)
    settings = WorkerSettings(
        redis=redis_settings,
        model=ModelSettings(model_dir="counting"),
        max_preemptions=max_preemptions,
        preempt=preempt,
    )
    publisher = Publisher(settings, rclient, tokenizer, worker_id)
    ensure_group(rclient, settings.redis.keys.inbox(worker_id), WORKER_GROUP)
    return WorkerService(settings, rclient, engine, worker_id, InlineLink(publisher))  # type: ignore[arg-type]


def message(
    request_id: str, priority: int, preemptions: int = 0, prompt_logprobs: int | None = None
) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    return GenerateRequest(
        id=request_id, prompt_ids=[3] * 8, params=params, created_ms=0, priority=priority, preemptions=preemptions
    )


def dispatch(rclient, keys, worker_id: str, msg: GenerateRequest) -> None:
    """As the router dispatches: a new epoch in the status hash, and with the request in the inbox."""
    rclient.hset(keys.meta(msg.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=0))
    epoch = rclient.hincrby(keys.meta(msg.id), "epoch", 1)
    rclient.xadd(keys.inbox(worker_id), {**entry(msg), "epoch": epoch})


def ask(rclient, keys, worker_id: str, *msgs: GenerateRequest) -> None:
    states = [[tuple(s) for s in request_states(m)] for m in msgs]
    one = PreemptAsk(
        request_ids=[m.id for m in msgs],
        priority=msgs[0].priority,
        states=[s for each in states for s in each],
        sizes=[len(each) for each in states],
        asked_ms=0,
    )
    rclient.rpush(keys.preempt(worker_id), encode(one))


def requeued(rclient, keys) -> list[GenerateRequest]:
    return [from_entry(GenerateRequest, f) for _, f in ingress.entries(rclient, keys)]


def chunks(rclient, keys, request_id: str) -> list[TokenChunk]:
    """Every token written, repeats included."""
    return [c for _, f in rclient.xrange(keys.chunks(request_id)) for c in parse_run(f).tokens()]


@pytest.mark.parametrize("prompt_logprobs", [None, 2])
def test_a_paused_request_resumes_elsewhere_token_identical(redis_settings, rclient, keys, tokenizer, prompt_logprobs):
    """With prompt logprobs asked for too: they went out with the first token, and the resumed
    attempt does not send them again."""
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    first = make_worker(redis_settings, rclient, tokenizer, "w-a")
    dispatch(rclient, keys, "w-a", message("old", priority=1, prompt_logprobs=prompt_logprobs))
    dispatch(rclient, keys, "w-a", message("new", priority=1, prompt_logprobs=prompt_logprobs))
    for _ in range(6):  # reads both, prefills, decodes a few tokens
        first._serve_once()
    assert first.load(1).preemptible == [(1, 2 * 8 + 2 * len(first.engine.running[0].output_ids), 2)]
    emitted = len(first.engine.running[1].output_ids)
    assert emitted > 0

    ask(rclient, keys, "w-a", message("urgent", priority=0))
    first._serve_once()  # reads the ask between steps: the newest of the worst class goes
    assert [r.id for r in first.engine.running] == ["old"]
    assert first.load(2).preempt_asks_read == 1  # the asking router's cue that the record shows it
    (back,) = requeued(rclient, keys)
    assert (back.id, back.preemptions, len(back.resume_ids)) == ("new", 1, emitted)
    assert [from_entry(GenerateRequest, f).id for _, f in rclient.xrange(keys.inbox("w-a"))] == ["old"]
    assert rclient.hget(keys.meta("new"), "status") == "queued"
    assert first.engine.num_preempted == 1 and first.engine.num_preempted_tokens >= 8 + emitted - 1

    second = make_worker(redis_settings, rclient, tokenizer, "w-b")
    dispatch(rclient, keys, "w-b", back)
    while first.engine.has_work or second.engine.has_work or rclient.xlen(keys.inbox("w-b")):
        first._serve_once()
        second._serve_once()
    resumed, reference = chunks(rclient, keys, "new"), chunks(rclient, keys, "old")
    assert [c.index for c in resumed] == list(range(MAX_NEW))  # each index once: none lost, none repeated
    assert [c.token_id for c in resumed] == [c.token_id for c in reference]
    assert rclient.hget(keys.meta("new"), "status") == "finished"
    scored = [c.prompt_logprobs for c in resumed if c.prompt_logprobs is not None]
    assert scored == [c.prompt_logprobs for c in reference if c.prompt_logprobs is not None]
    assert len(scored) == (0 if prompt_logprobs is None else 1)  # once, with the first token


def test_the_bound_and_the_fit_decide_what_is_paused(redis_settings, rclient, keys, tokenizer):
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    worker = make_worker(redis_settings, rclient, tokenizer, "w-k", max_preemptions=1)
    dispatch(rclient, keys, "w-k", message("once", priority=2, preemptions=1))  # paused once already: K = 1
    dispatch(rclient, keys, "w-k", message("same", priority=0))
    for _ in range(3):
        worker._serve_once()
    assert [p for p, *_ in worker.load(1).preemptible] == [0]  # "once" is at the bound: not listed
    ask(rclient, keys, "w-k", message("urgent", priority=0))
    worker._serve_once()
    assert requeued(rclient, keys) == [] and len(worker.engine.running) == 2  # nothing paused in vain

    ask(rclient, keys, "w-k", message("best", priority=-1))  # "same" may go, "once" may not: it is enough
    worker._serve_once()
    assert [r.id for r in requeued(rclient, keys)] == ["same"]
    assert [r.id for r in worker.engine.running] == ["once"]


def test_requests_sent_with_the_ask_are_admitted_in_the_same_turn(redis_settings, rclient, keys, tokenizer):
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    worker = make_worker(redis_settings, rclient, tokenizer, "w-s")
    for request_id in ("a", "b"):
        dispatch(rclient, keys, "w-s", message(request_id, priority=1))
    for _ in range(3):
        worker._serve_once()
    urgent = [message("u1", priority=0), message("u2", priority=0)]
    for msg in urgent:  # the router sends them with the ask: read in the same round trip
        dispatch(rclient, keys, "w-s", msg)
    ask(rclient, keys, "w-s", *urgent)
    worker._serve_once()  # counted once each (not as queued here and asked for): both class-1 requests go
    assert sorted(r.id for r in requeued(rclient, keys)) == ["a", "b"]
    assert [r.id for r in worker.engine.running] == ["u1", "u2"]  # admitted in this very step


@pytest.mark.parametrize("preempt", [False, True], ids=["router-only", "worker-preempt"])
def test_a_better_class_sent_without_an_ask_makes_room_on_a_worker_with_preempt(
    redis_settings, rclient, keys, tokenizer, preempt
):
    """A router sent a class-0 request on a record that showed room, so without an ask: a worker with
    --preempt pauses the newest worse-class request for it, as an ask would have; one without lets it
    wait. A same-class arrival pauses nothing either way."""
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    worker = make_worker(redis_settings, rclient, tokenizer, f"w-u{int(preempt)}", preempt=preempt)
    for request_id in ("a", "b"):
        dispatch(rclient, keys, worker.worker_id, message(request_id, priority=1))
    for _ in range(3):
        worker._serve_once()
    dispatch(rclient, keys, worker.worker_id, message("same", priority=1))  # fits nowhere here, and no better
    worker._serve_once()
    assert requeued(rclient, keys) == [] and [r.id for r in worker.engine.waiting] == ["same"]

    dispatch(rclient, keys, worker.worker_id, message("urgent", priority=0))  # no ask sent with it
    worker._serve_once()
    if preempt:
        # the newest of the worse class first: "same", which never started (it loses nothing), then "b"
        assert [r.id for r in requeued(rclient, keys)] == ["same", "b"]
        assert sorted(r.id for r in worker.engine.running) == ["a", "urgent"]
    else:
        assert requeued(rclient, keys) == []
        assert sorted(r.id for r in worker.engine.running) == ["a", "b"]
