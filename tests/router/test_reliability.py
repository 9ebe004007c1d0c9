"""What the router does when workers, routers or deadlines fail (real Redis)."""

import time

import pytest

from router.loop import Router
from shared.codec import entry, from_entry
from shared.config import RouterSettings
from shared.keys import ROUTER_GROUP
from shared.request_log import now_ms
from shared.schemas import DeadLetter, GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.router.helpers import inbox_ids, publish_load, submit


def make_router(redis_settings, rclient, name="r1", **settings):
    return Router(RouterSettings(redis=redis_settings, poll_ms=10, **settings), rclient, name)


def meta(rclient, keys, request_id) -> RequestMeta:
    return RequestMeta.from_hash(rclient.hgetall(keys.meta(request_id)))


def kill(rclient, keys, worker_id):
    rclient.delete(keys.load(worker_id))


def start(rclient, keys, request_id, worker_id, stepped_ms):
    """What the worker's publisher writes as it admits a request, before its first forward."""
    fields = RequestMeta.fields(status=RequestStatus.RUNNING, worker=worker_id, stepped_ms=stepped_ms)
    rclient.hset(keys.meta(request_id), mapping=fields)


def test_a_request_whose_workers_keep_dying_is_dead_lettered(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient, max_attempts=2)
    submit(rclient, keys, "poison")
    for attempt, worker in enumerate(["w1", "w2"]):
        publish_load(rclient, keys, worker)
        router.step()
        router.step()
        assert inbox_ids(rclient, keys, worker) == ["poison"], attempt
        start(rclient, keys, "poison", worker, now_ms())
        kill(rclient, keys, worker)
    router.step()  # reaps w2: the second death was the last attempt
    status = meta(rclient, keys, "poison")
    assert status.status is RequestStatus.FAILED and "dead-lettered" in status.error
    [(_, fields)] = rclient.xrange(keys.dead_letters())
    letter = from_entry(DeadLetter, fields)
    assert letter.request.id == "poison" and "died" in letter.reason and letter.raw is None
    assert rclient.xlen(keys.requests()) == 2  # the original and one re-dispatch, nothing more


def test_entries_of_a_dead_router_are_taken_over_by_a_live_one(redis_settings, rclient, keys):
    first = make_router(redis_settings, rclient, name="r1", liveness_ttl_s=0.3)
    submit(rclient, keys, "a")
    submit(rclient, keys, "b")
    first.step()  # reads both, no worker: both stay in r1's pending list
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["consumers"][0]["name"] == "r1"
    time.sleep(0.4)  # r1 stops beating: its liveness key expires
    publish_load(rclient, keys, "w1")
    second = make_router(redis_settings, rclient, name="r2", liveness_ttl_s=0.3)
    second.step()
    second.step()
    assert inbox_ids(rclient, keys, "w1") == ["a", "b"]
    assert [c["name"] for c in rclient.xinfo_consumers(keys.requests(), ROUTER_GROUP)] == ["r2"]


def test_a_live_router_keeps_what_it_holds(redis_settings, rclient, keys):
    first = make_router(redis_settings, rclient, name="r1", liveness_ttl_s=30)
    submit(rclient, keys, "a")
    first.step()
    second = make_router(redis_settings, rclient, name="r2", liveness_ttl_s=30)
    second.step()
    assert len(second.queue) == 0 and len(first.queue) == 1


def queue_past_deadline(rclient, keys, request_id: str, max_new_tokens: int, **progress) -> None:
    """A queued request whose deadline has passed (``progress``: what an earlier attempt emitted),
    and a worker w1 with room for it."""
    msg = GenerateRequest(
        id=request_id,
        prompt_ids=[1, 2],
        params=SamplingParams(max_new_tokens=max_new_tokens),
        created_ms=now_ms(),
        deadline_ms=now_ms() - 1,
        **progress,
    )
    rclient.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED))
    rclient.xadd(keys.requests(), entry(msg))
    publish_load(rclient, keys, "w1")


def test_a_request_past_its_deadline_expires_without_running(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    queue_past_deadline(rclient, keys, "late", 4)
    router.step()
    assert meta(rclient, keys, "late").status is RequestStatus.EXPIRED
    assert inbox_ids(rclient, keys, "w1") == []
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 0


@pytest.mark.parametrize(
    "progress",
    [{"resume_ids": [7, 8, 9]}, {"n": 2, "group_resume": [[7], []]}, {"n": 2, "finished_choices": [0]}],
    ids=["resumed", "group-resumed", "group-choice-finished"],
)
def test_an_answer_under_way_is_never_expired_by_its_deadline(redis_settings, rclient, keys, progress):
    """Back in the queue with tokens out (its worker died, or it was paused for a better class) and
    past its deadline: it goes on to a worker (red team 7: a started stream ended ``expired``)."""
    router = make_router(redis_settings, rclient)
    queue_past_deadline(rclient, keys, "going", 8, **progress)
    router.step()
    assert meta(rclient, keys, "going").status is not RequestStatus.EXPIRED
    assert inbox_ids(rclient, keys, "w1") == ["going"]


def test_router_recreates_a_lost_consumer_group(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    router.step()
    rclient.delete(keys.requests())  # what a Redis restart without persistence looks like
    router._next_housekeeping = 0
    submit(rclient, keys, "x")
    publish_load(rclient, keys, "w1")
    router.step()
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["x"]


def test_a_read_that_finds_the_group_lost_makes_it_again_at_once(redis_settings, rclient, keys):
    """Redis restarted empty (or flushed) between two reads, long before housekeeping looks: the read
    itself makes the group again; the router does not raise (it exited, and serve took three such
    exits in a minute for a failed start and stopped the whole pool)."""
    router = make_router(redis_settings, rclient)
    router.step()
    rclient.delete(keys.requests())  # the stream and its group gone
    submit(rclient, keys, "x")  # a producer's XADD: the stream again, without the group
    router.step()  # raised NOGROUP here before
    publish_load(rclient, keys, "w1")
    router.step()
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["x"]


def test_a_cleanly_stopped_router_leaves_the_group_unless_it_holds_entries(redis_settings, rclient, keys):
    """So the next router reports only a router that died as gone; held entries stay claimable."""
    from router import liveness

    publish_load(rclient, keys, "w1")
    idle = make_router(redis_settings, rclient, name="idle")
    submit(rclient, keys, "a")
    idle.step()  # dispatched and acked: nothing pending
    holding = make_router(redis_settings, rclient, name="holding")
    publish_load(rclient, keys, "w1", committed=900)
    submit(rclient, keys, "big", prompt_len=400, max_new=400)  # no room on w1 now: stays pending
    holding.step()
    liveness.forget(rclient, keys, "idle")
    liveness.forget(rclient, keys, "holding")
    names = {c["name"] for c in rclient.xinfo_consumers(keys.requests(), ROUTER_GROUP)}
    assert "idle" not in names and "holding" in names
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 1


def test_a_death_without_a_word_is_blamed_on_the_last_admission(redis_settings, rclient, keys):
    """Killed, a worker says nothing of the step that killed it: the requests it admitted last are
    blamed (attempt + 1); the others running there ran through it (deaths + 1); one it never
    started is neither."""
    router = make_router(redis_settings, rclient, max_attempts=3)
    for request_id in ("old", "new1", "new2", "unstarted"):
        submit(rclient, keys, request_id)
    publish_load(rclient, keys, "w1")
    router.step()
    router.step()
    assert sorted(inbox_ids(rclient, keys, "w1")) == ["new1", "new2", "old", "unstarted"]
    start(rclient, keys, "old", "w1", 1000)
    start(rclient, keys, "new1", "w1", 2000)
    start(rclient, keys, "new2", "w1", 2000)
    kill(rclient, keys, "w1")
    router.step()
    back = {r.id: r for r in (from_entry(GenerateRequest, f) for _, f in rclient.xrange(keys.requests())[4:])}
    assert {rid: (r.attempt, r.deaths) for rid, r in back.items()} == {
        "old": (0, 1),
        "new1": (1, 1),
        "new2": (1, 1),
        "unstarted": (0, 0),
    }
