"""The router against a real Redis, with workers played by the test."""

import time

import pytest

from router.loop import Router
from router.workers.janitor import reap_dead_worker
from shared.chunk_schemas import TokenChunk
from shared.chunks import emitted_chunks
from shared.codec import from_entry
from shared.config import CANCEL_CHECK_S, AdmissionSettings, RouterSettings
from shared.keys import ROUTER_GROUP, Keys
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus
from tests.chunks import append_chunk
from tests.router.helpers import finished_lengths, inbox_ids, publish_load, start_on, submit


def make_router(redis_settings, rclient, name="r1", **settings):
    router = Router(RouterSettings(redis=redis_settings, poll_ms=10, **settings), rclient, name)
    from shared.redis import ensure_group

    ensure_group(rclient, router.keys.requests(), ROUTER_GROUP)
    return router


def test_dispatches_in_order_to_the_least_loaded_and_acks(any_redis):
    redis_settings, rclient = any_redis
    keys = Keys(redis_settings.key_prefix)
    publish_load(rclient, keys, "w1", max_total=100, committed=30)
    publish_load(rclient, keys, "w2", max_total=100)
    router = make_router(redis_settings, rclient)
    for i in range(3):
        submit(rclient, keys, f"q{i}", 10, 10)
    router.step()
    # w2 has 100 free, w1 70: q0 -> w2 (80 left), q1 -> w2 (60 left), q2 -> w1 (70 > 60)
    assert inbox_ids(rclient, keys, "w2") == ["q0", "q1"]
    assert inbox_ids(rclient, keys, "w1") == ["q2"]
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 0
    assert RequestMeta.from_hash(rclient.hgetall(keys.meta("q0"))).worker == "w2"


def test_request_waits_in_order_until_a_worker_has_room(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=100, requests=[(50, 0, 45, 1)])  # 50 held, 45 to come
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "big", 20, 20)  # 50 + 20 + 20 + 20 at its end: over 100
    submit(rclient, keys, "small", 1, 1)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == []  # small waits behind big: arrival order
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 2
    publish_load(rclient, keys, "w1", max_total=100, last_inbox_id="0-0")
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["big", "small"]


def test_restarted_router_finishes_its_pending_entries(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q0")
    router.step()  # read, no worker: stays pending in r1's list
    publish_load(rclient, keys, "w1")
    again = make_router(redis_settings, rclient)  # same consumer name, fresh memory
    again.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0"]


def test_cancelled_request_is_finalised_without_dispatch(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q0")
    rclient.set(keys.cancel("q0"), 1)
    router.step()
    meta = RequestMeta.from_hash(rclient.hgetall(keys.meta("q0")))
    assert meta.status is RequestStatus.CANCELLED
    assert emitted_chunks(rclient, keys, "q0")[-1].finish_reason == "cancelled"
    assert rclient.ttl(keys.meta("q0")) > 0


def test_cancelled_and_expired_requests_end_wherever_they_wait(redis_settings, rclient, keys):
    """Not only at the head of the queue: behind a request that waits for room, a cancelled stream
    stayed open and a 0.5 s timeout ended after 21 s (red team 3)."""
    publish_load(rclient, keys, "w1", max_total=100, requests=[(50, 0, 45, 1)])  # no room for "big"
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "big", 20, 20)
    submit(rclient, keys, "gone", 1, 1)
    submit(rclient, keys, "late", 1, 1, deadline_ms=now_ms() + 200)
    submit(rclient, keys, "kept", 1, 1)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == []  # every one waits behind "big"
    rclient.set(keys.cancel("gone"), 1)
    time.sleep(CANCEL_CHECK_S + 0.25)  # the next look at cancels, and past "late"'s deadline
    router.step()
    status = {r: RequestMeta.from_hash(rclient.hgetall(keys.meta(r))).status for r in ("big", "gone", "late", "kept")}
    assert status == {
        "big": RequestStatus.QUEUED,
        "gone": RequestStatus.CANCELLED,
        "late": RequestStatus.EXPIRED,
        "kept": RequestStatus.QUEUED,
    }
    assert emitted_chunks(rclient, keys, "late")[-1].finish_reason == "expired"
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 2  # big and kept, still in order
    publish_load(rclient, keys, "w1", max_total=100)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["big", "kept"]


def test_dead_worker_requests_go_back_with_emitted_tokens(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", ttl_ms=5000)
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q0", 5, 10)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0"]
    start_on(rclient, keys, "q0", "w1")  # it runs there: w1's death is blamed on it
    pipe = rclient.pipeline()
    for i, tok in enumerate([7, 8, 9]):
        append_chunk(pipe, keys, TokenChunk(request_id="q0", index=i, token_id=tok, text="x"))
    pipe.execute()
    rclient.delete(keys.load("w1"))  # w1 dies
    publish_load(rclient, keys, "w2")
    router.step()  # reaps w1: q0 goes back to the ingress stream
    router.step()  # and on to w2
    [(_, fields)] = rclient.xrange(keys.inbox("w2"))
    again = from_entry(GenerateRequest, fields)
    assert again.id == "q0" and again.attempt == 1 and again.resume_ids == [7, 8, 9]
    assert rclient.zscore(keys.workers(), "w1") is None
    assert not rclient.exists(keys.inbox("w1"))


@pytest.mark.parametrize(
    "policy, ignore_eos, expected",
    [
        ("conservative", False, 4),  # 4 x (100 + 400) = 2,000: the pool
        ("past_future", False, 10),  # history: outputs of 20 tokens, so each needs about 120
        ("past_future", True, 3),  # exact 500 each, and 4 x 500 > 2,000 x 0.95
    ],
)
def test_policy_decides_how_much_one_worker_takes(redis_settings, rclient, keys, policy, ignore_eos, expected):
    publish_load(rclient, keys, "w1", max_total=2000, requests=[], running_max=64)
    finished_lengths(rclient, keys, [20] * 200)
    router = make_router(redis_settings, rclient, admission_rule=AdmissionSettings(admission=policy))
    for i in range(10):
        submit(rclient, keys, f"q{i}", 100, 400, ignore_eos=ignore_eos)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == [f"q{i}" for i in range(expected)]
    assert len(router.reservations.pending()["w1"]) == expected


def test_history_is_read_from_redis_with_the_prior_filling_the_rest(redis_settings, rclient, keys):
    finished_lengths(rclient, keys, [7, 8, 9])
    router = make_router(
        redis_settings, rclient, admission_rule=AdmissionSettings(history_window=10, history_prior=500)
    )
    router.step()
    assert router.rule.history.values == [7, 8, 9] + [500] * 5


def test_published_requests_count_against_the_worker(redis_settings, rclient, keys):
    finished_lengths(rclient, keys, [20] * 200)
    # w1 runs one ignore_eos request that will grow to 1,600 tokens; w2 is empty but smaller
    publish_load(rclient, keys, "w1", max_total=2000, requests=[(600, 0, 1000, 1)])
    publish_load(rclient, keys, "w2", max_total=1000, requests=[])
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q0", 300, 100, ignore_eos=True)  # 400 more: w1 would peak at 2,000 > 1,900
    router.step()
    assert inbox_ids(rclient, keys, "w2") == ["q0"]


def test_stale_record_counts_as_full(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", requests=[], age_ms=60_000)
    router = make_router(redis_settings, rclient, stale_load_s=5)
    submit(rclient, keys, "q0")
    router.step()
    assert inbox_ids(rclient, keys, "w1") == []
    publish_load(rclient, keys, "w1", requests=[])
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0"]


def test_a_worker_that_came_back_and_died_again_is_reaped_again(redis_settings, rclient, keys):
    """The reap lock lasts the reap: a worker the pool gave up on, that came back (cut off, frozen)
    and then died for good, has its requests sent on at once (its lock used to stand for a minute)."""
    publish_load(rclient, keys, "w1", ttl_ms=5000)
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "q0", 5, 10)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0"]
    rclient.delete(keys.load("w1"))
    assert reap_dead_worker(rclient, keys, "w1", ttl_s=60) == 1
    publish_load(rclient, keys, "w1", ttl_ms=5000)  # back
    router.step()
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0"]
    rclient.delete(keys.load("w1"))  # and gone again
    assert reap_dead_worker(rclient, keys, "w1", ttl_s=60) == 1
    assert not rclient.exists(keys.reap_lock("w1"))
