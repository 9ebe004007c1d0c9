"""A queued request that no live worker could ever start, even with nothing else running (its
samples' KV tokens over every pool, or more samples than a worker runs at once), ends at once with
``request_too_large`` (the producer's 400), and the requests behind it go on: it used to wait at
the head of its class's queue for ever, holding every request of its class and worse classes
(found by a red-team probe: ``n`` = 8 and ``max_tokens`` 2,040 on pools of 8,192 tokens). While
no worker is up, or one could take it, it waits as before."""

from __future__ import annotations

from producer.api.structured import failure
from shared.chunks import emitted_chunks
from shared.schemas import RequestMeta, RequestStatus
from shared.worker_load import TOO_LARGE, is_too_large
from tests.router.helpers import inbox_ids, publish_load, submit
from tests.router.test_loop import make_router


def status(rclient, keys, request_id: str) -> RequestStatus:
    return RequestMeta.from_hash(rclient.hgetall(keys.meta(request_id))).status


def test_a_group_over_every_pool_ends_and_the_queue_moves_on(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=1000)
    publish_load(rclient, keys, "w2", max_total=1200)
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "huge", prompt_len=10, max_new=200, n=8, ignore_eos=True)  # 10 + 8 x 200 = 1,610
    submit(rclient, keys, "small", prompt_len=10, max_new=10)
    router.step()
    assert status(rclient, keys, "huge") is RequestStatus.FAILED
    last = emitted_chunks(rclient, keys, "huge")[-1]
    assert last.finish_reason == "error" and is_too_large(last.error)
    assert "1610 KV tokens" in last.error and "1200" in last.error, last.error
    assert inbox_ids(rclient, keys, "w1") + inbox_ids(rclient, keys, "w2") == ["small"]
    answer = failure(last.error)  # what the producer tells the client
    assert answer.status == 400 and answer.detail.code == TOO_LARGE and "lower max_tokens or n" in answer.detail.message


def test_more_samples_than_a_worker_runs_at_once_end(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=100_000, running_max=4)
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "wide", max_new=5, n=6)
    router.step()
    last = emitted_chunks(rclient, keys, "wide")[-1]
    assert is_too_large(last.error) and "at most 4 requests" in last.error, last.error


def test_it_waits_while_no_worker_is_up_or_one_could_take_it(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "early", prompt_len=10, max_new=200, n=8, ignore_eos=True)
    router.step()  # no worker yet: a large one may be starting
    assert status(rclient, keys, "early") is RequestStatus.QUEUED
    publish_load(rclient, keys, "busy", max_total=4000, committed=3000)  # full now, but it fits when empty
    router.step()
    assert status(rclient, keys, "early") is RequestStatus.QUEUED
    publish_load(rclient, keys, "busy", max_total=4000, committed=0)
    router.step()
    assert inbox_ids(rclient, keys, "busy") == ["early"]
