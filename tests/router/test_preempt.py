"""The router's side of preempt and resume (``--preempt``, router.preempt): it asks a worker to
make room only when the best waiting request fits no worker and some worker runs a worse class;
one ask at a time, until the asked worker has answered."""

from __future__ import annotations

from router.loop import Router
from router.preempt import victim_worker, within
from shared.codec import decode, encode
from shared.config import RouterSettings
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_load import PreemptAsk, WorkerLoad
from tests.router.helpers import inbox_ids, submit


def load(worker_id: str, held: int, preemptible=(), seq: int = 1, max_total: int = 100, **fields) -> WorkerLoad:
    """A record of one request holding ``held`` tokens with nothing left to add."""
    return WorkerLoad(
        worker_id=worker_id,
        seq=seq,
        ts_ms=now_ms(),
        max_total_tokens=max_total,
        used_tokens=held,
        committed_tokens=held,
        num_running=1,
        num_waiting=0,
        requests=[(held, 0, 0, 0)],
        preemptible=list(preemptible),
        **fields,
    )


def publish(rclient, keys, record: WorkerLoad) -> None:
    rclient.set(keys.load(record.worker_id), encode(record), px=5000)
    rclient.zadd(keys.workers(), {record.worker_id: now_ms()})


def make_router(redis_settings, rclient, preempt: bool = True) -> Router:
    router = Router(RouterSettings(redis=redis_settings, poll_ms=1, preempt=preempt), rclient, "r1")
    ensure_group(rclient, router.keys.requests(), ROUTER_GROUP)
    return router


def asks(rclient, keys, worker_id: str) -> list[PreemptAsk]:
    return [decode(PreemptAsk, raw) for raw in rclient.lrange(keys.preempt(worker_id), 0, -1)]


def request(priority: int, model: str | None = None) -> GenerateRequest:
    return GenerateRequest(
        id="x", prompt_ids=[1], params=SamplingParams(), created_ms=0, priority=priority, model=model
    )


def test_the_worker_with_the_worst_class_is_asked():
    loads = {
        "a": load("a", 90, [(1, 50, 1)]),
        "b": load("b", 90, [(3, 10, 1), (1, 80, 2)]),  # the worst class wins over more tokens
        "c": load("c", 90, [(5, 90, 1)], draining=True),
        "d": load("d", 90, [(9, 90, 1)], model="other"),
    }
    assert victim_worker(request(0, model="main"), loads) == "b"  # "d" serves another model
    assert victim_worker(request(3, model="main"), loads) is None  # only worse classes count, never equal ones
    assert victim_worker(request(0, model="other"), loads) == "d"
    two = {"a": load("a", 90, [(1, 50, 1)]), "e": load("e", 90, [(1, 60, 1)])}
    assert victim_worker(request(0), two) == "e"
    assert victim_worker(request(0), two, {"e": (20, 0)}) == "a"  # tokens promised to earlier asks
    assert victim_worker(request(0), two, {"e": (0, 1)}) == "a"  # its one request is promised
    assert victim_worker(request(0), two, {"a": (50, 0), "e": (60, 0)}) is None


def test_an_ask_only_when_the_best_request_fits_nowhere_and_a_worse_class_runs(any_redis):
    redis_settings, rclient = any_redis
    keys = Keys(redis_settings.key_prefix)
    router = make_router(redis_settings, rclient)
    publish(rclient, keys, load("w1", 95, [(0, 95, 1)]))  # full, of the request's own class
    submit(rclient, keys, "urgent", 5, 5, priority=0)
    router.step()
    assert asks(rclient, keys, "w1") == [] and inbox_ids(rclient, keys, "w1") == []  # nothing worse: it waits

    publish(rclient, keys, load("w1", 95, [(1, 10, 2)], seq=2))  # now a worse class runs there (2 requests, 10 tokens)
    submit(rclient, keys, "next", 5, 5, priority=0)
    submit(rclient, keys, "later", 5, 5, priority=1)
    router.step()
    (sent,) = asks(rclient, keys, "w1")
    assert (sent.request_ids, sent.priority, sent.sizes) == (["urgent", "next"], 0, [1, 1])
    assert sent.states == [(5, 0, 5, 0)] * 2
    assert 0 < rclient.pttl(keys.preempt("w1")) <= 2000
    # Sent with the ask (the worker pauses, then admits them in one turn); class 1 waits.
    assert inbox_ids(rclient, keys, "w1") == ["urgent", "next"]

    submit(rclient, keys, "third", 5, 5, priority=0)
    router.step()
    # The 10 tokens are promised (5 held by each request asked for) until the record shows an answer.
    assert len(asks(rclient, keys, "w1")) == 1 and "third" not in inbox_ids(rclient, keys, "w1")
    publish(rclient, keys, load("w1", 95, [(1, 10, 2)], seq=3, preempt_asks_read=1))
    router.step()
    assert [a.request_ids for a in asks(rclient, keys, "w1")] == [["urgent", "next"], ["third"]]
    assert inbox_ids(rclient, keys, "w1") == ["urgent", "next", "third"]


def test_an_ask_sends_no_more_requests_than_the_worker_has_to_pause(redis_settings, rclient, keys):
    """A pause frees one request slot: with one request of a worse class there, one of three waiting
    requests goes with the ask and the others wait at the router, in its order (a burst of short
    prompts once booked few tokens an ask and went dozens deep into such a worker's queue)."""
    router = make_router(redis_settings, rclient)
    publish(rclient, keys, load("w1", 95, [(1, 90, 1)]))
    for name in ("a", "b", "c"):
        submit(rclient, keys, name, 1, 5, priority=0)
    router.step()
    assert [a.request_ids for a in asks(rclient, keys, "w1")] == [["a"]]
    assert inbox_ids(rclient, keys, "w1") == ["a"]


def test_no_ask_when_the_request_fits_somewhere_or_preemption_is_off(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    publish(rclient, keys, load("w1", 95, [(1, 95, 1)]))
    publish(rclient, keys, load("w2", 0, []))
    submit(rclient, keys, "fits", 5, 5, priority=0)
    router.step()
    assert inbox_ids(rclient, keys, "w2") == ["fits"] and asks(rclient, keys, "w1") == []

    rclient.delete(keys.load("w2"))
    rclient.zrem(keys.workers(), "w2")
    off = make_router(redis_settings, rclient, preempt=False)
    submit(rclient, keys, "waits", 5, 5, priority=0)
    off.step()
    assert asks(rclient, keys, "w1") == [] and inbox_ids(rclient, keys, "w1") == []


def test_an_ask_takes_requests_while_their_samples_fit_the_slots_it_can_free():
    one, group = ("s",), ("s", "s")  # a request's states: one per sample
    assert within(3, [one, group, one]) == [one, group]
    assert within(4, [one, one, one]) == [one, one, one]
    assert within(1, [group, one]) == [group]  # the head always goes: the worker's plan decides
