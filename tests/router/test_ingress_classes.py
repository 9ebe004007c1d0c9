"""One ingress stream per priority class (shared.ingress) against a real Redis: a flood of a worse
class larger than the router's window no longer hides a better request behind it; entries of two
classes with the same stream id are both served and acknowledged where they were read; entries
queued before streams were per class are still acknowledged in class 0's stream."""

from __future__ import annotations

from router.loop import Router
from shared import ingress
from shared.codec import entry, from_entry
from shared.config import RouterSettings
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import ensure_group
from shared.schemas import GenerateRequest
from tests.router.helpers import inbox_ids, publish_load, submit


def make_router(redis_settings, rclient, **settings) -> Router:
    return Router(RouterSettings(redis=redis_settings, poll_ms=10, **settings), rclient, "r1")


def pending(rclient, stream: str) -> int:
    return rclient.xpending(stream, ROUTER_GROUP)["pending"]


def test_a_flood_larger_than_the_window_does_not_hide_a_better_class(any_redis):
    redis_settings, rclient = any_redis
    keys = Keys(redis_settings.key_prefix)
    flood = [submit(rclient, keys, f"low{i}", priority=1) for i in range(12)]
    submit(rclient, keys, "urgent", priority=0)  # arrives after 12 class-1 requests; the window is 4
    router = make_router(redis_settings, rclient, order_window=4, read_batch=4)
    for _ in range(3):  # no worker yet: the router fills its window
        router.step()
    held = [request.id for _, request in router.queue]
    assert "urgent" in held and len([i for i in held if i.startswith("low")]) <= 4 + 4
    publish_load(rclient, keys, "w1", max_total=10**9, running_max=1)  # room for one request
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["urgent"]
    assert rclient.zrange(keys.classes(), 0, -1) == ["0", "1"]
    assert rclient.xlen(keys.requests(1)) == len(flood) and rclient.xlen(keys.requests(0)) == 1


def test_the_same_entry_id_in_two_classes_is_two_requests(redis_settings, rclient, keys):
    a = submit(rclient, keys, "a", priority=0)  # helpers.submit writes each to its class's stream
    rclient.delete(keys.requests(0))
    b = a.model_copy(update={"id": "b", "priority": 2})
    rclient.hset(keys.meta("b"), "status", "queued")
    rclient.xadd(keys.requests(0), entry(a), id="5-1")
    rclient.xadd(keys.requests(2), entry(b), id="5-1")
    rclient.zadd(keys.classes(), {"2": 2})
    router = make_router(redis_settings, rclient)
    publish_load(rclient, keys, "w1", max_total=10**9)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["a", "b"]
    assert pending(rclient, keys.requests(0)) == 0 and pending(rclient, keys.requests(2)) == 0


def test_an_entry_queued_before_streams_were_per_class_is_acknowledged_where_it_is(redis_settings, rclient, keys):
    old = submit(rclient, keys, "old", priority=3)
    rclient.delete(keys.requests(3))
    rclient.xadd(keys.requests(0), entry(old))  # one stream for every class, as before
    ensure_group(rclient, keys.requests(0), ROUTER_GROUP)
    router = make_router(redis_settings, rclient)
    publish_load(rclient, keys, "w1", max_total=10**9)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["old"]
    assert pending(rclient, keys.requests(0)) == 0  # acknowledged in the stream it was read from


def test_streams_lists_class_zero_and_every_class_written(rclient, keys):
    assert ingress.streams(rclient, keys) == [(0, keys.requests())]
    submit(rclient, keys, "x", priority=-4)
    submit(rclient, keys, "y", priority=7)
    assert ingress.streams(rclient, keys) == [(-4, keys.requests(-4)), (0, keys.requests()), (7, keys.requests(7))]
    assert [from_entry(GenerateRequest, f).id for _, f in ingress.entries(rclient, keys)] == ["x", "y"]


def test_a_dead_routers_entries_are_taken_over_in_every_class(redis_settings, rclient, keys):
    for i, priority in enumerate([1, 0, 2]):
        submit(rclient, keys, f"q{i}", priority=priority)
    dead = Router(RouterSettings(redis=redis_settings, poll_ms=10), rclient, "dead")
    dead.step()  # reads all three (no worker yet): they are pending under its name
    assert len(dead.queue) == 3
    rclient.delete(keys.router_alive("dead"))  # it died: its liveness key expired
    heir = make_router(redis_settings, rclient)
    publish_load(rclient, keys, "w1", max_total=10**9)
    heir.step()
    assert inbox_ids(rclient, keys, "w1") == ["q1", "q0", "q2"]
    assert all(pending(rclient, keys.requests(p)) == 0 for p in (0, 1, 2))
