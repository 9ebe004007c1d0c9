"""shared.request_log against a real Redis: ending a request from outside its worker, and its fences."""

from __future__ import annotations

import pytest

from shared.request_log import end_request, fence
from shared.schemas import RequestMeta, RequestStatus


@pytest.mark.parametrize("dispatched", [False, True])
def test_a_data_fence_only_where_a_worker_ever_held_the_request(rclient, keys, dispatched):
    """Ended in the queue (cancelled, past its deadline), a request no dispatch ever took an epoch for
    has no writer to fence out: no data fence, which lives a week (a red team's soak found one left by
    every request that expired queued). Dispatched once, its holder's runs are refused from the end."""
    rid = f"r-{dispatched}"
    rclient.hset(keys.meta(rid), mapping=RequestMeta.fields(status=RequestStatus.QUEUED))
    if dispatched:
        rclient.hincrby(keys.meta(rid), "epoch", 1)  # what a dispatch does
    ended = end_request(rclient, keys, rid, status=RequestStatus.EXPIRED, reason="expired", num_output=0, ttl_s=60)
    assert ended and rclient.hget(keys.meta(rid), "status") == "expired"
    assert rclient.exists(keys.data_fence(rid)) == dispatched
    if dispatched:
        assert int(rclient.get(keys.data_fence(rid))) == 2
    assert all(0 < rclient.ttl(key) <= 60 for key in keys.all_request_keys(rid) if rclient.exists(key))
    assert fence(rclient, keys, rid) < 0  # ended: nothing more to take
    rclient.delete(keys.data_fence(rid))
