"""router.order.ordering against a real Redis: strict classes, fair token shares between tenants (checked
against a brute-force virtual-token-counter model), the same order from two routers at once, and
nothing lost or reordered when a router restarts."""

from __future__ import annotations

import random
import threading
import time
from collections import deque

import pytest

from router.loop import Router
from router.order.ordering import cost, parse_weights
from shared.config import RouterSettings
from shared.keys import ROUTER_GROUP, class_tenant_field
from shared.redis import ensure_group
from shared.schemas import GenerateRequest
from tests.router.helpers import inbox_ids, publish_load, submit

BIG = 10**9  # a worker this large takes everything: the order alone decides the inbox


def make_router(redis_settings, rclient, name="r1", **settings) -> Router:
    router = Router(RouterSettings(redis=redis_settings, poll_ms=10, **settings), rclient, name)
    ensure_group(rclient, router.keys.requests(), ROUTER_GROUP)
    return router


def vtc_model(requests: list[GenerateRequest], weights: dict[str, float]) -> list[str]:
    """Brute force: every request arrived before the first decision; then, again and again, the best
    class with work, in it the tenant with the smallest counter (ties: the earliest arrival at the
    head of its line), which is charged cost / weight. The OSDI 2024 paper's selection rule."""
    lines: dict[tuple[int, str], deque] = {}
    for at, r in enumerate(requests):
        lines.setdefault((r.priority, r.tenant), deque()).append((at, r))
    counters = {line: 0.0 for line in lines}
    order = []
    while any(lines.values()):
        best = min(p for (p, _), line in lines.items() if line)
        line = min((k for k, v in lines.items() if k[0] == best and v), key=lambda k: (counters[k], lines[k][0][0]))
        _, r = lines[line].popleft()
        counters[line] += cost(r) / weights.get(r.tenant, 1.0)
        order.append(r.id)
    return order


def test_classes_are_served_strictly_lower_first(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    for i, priority in enumerate([1, 1, 0, 5, -2, 0]):
        submit(rclient, keys, f"q{i}", priority=priority)
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["q4", "q2", "q5", "q0", "q1", "q3"]
    # Everything dispatched: the order keeps nothing behind.
    assert not rclient.exists(keys.waiting(None), keys.order(0), keys.order(1), keys.tenant_queued())


@pytest.mark.parametrize("seed", range(4))
def test_fair_shares_match_a_brute_force_model(redis_settings, rclient, keys, seed):
    rng = random.Random(seed)
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    sent = [
        submit(
            rclient,
            keys,
            f"q{i}",
            prompt_len=rng.randint(1, 40),
            max_new=rng.randint(1, 40),
            priority=rng.choice([0, 0, 0, 1]),
            tenant=rng.choice(["a", "a", "a", "a", "b", "c"]),  # a floods
        )
        for i in range(40)
    ]
    router = make_router(redis_settings, rclient, tenant_weights="a=1,b=2,c=0.5", read_batch=64)
    router.step()  # reads (and tags) everything; no worker yet
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == vtc_model(sent, weights)


def test_a_flood_gets_the_same_token_rate_as_a_small_tenant(redis_settings, rclient, keys):
    flood = [submit(rclient, keys, f"a{i}", 10, 10, tenant="a") for i in range(50)]
    small = [submit(rclient, keys, f"b{i}", 10, 10, tenant="b") for i in range(5)]
    router = make_router(redis_settings, rclient)
    router.step()
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()
    first = inbox_ids(rclient, keys, "w1")[:10]
    assert sorted(first) == sorted([r.id for r in flood[:5]] + [r.id for r in small])  # 5 each, not 10:1
    served = rclient.hgetall(keys.tenant_served())
    assert served == {class_tenant_field(0, "a"): str(50 * 20), class_tenant_field(0, "b"): str(5 * 20)}


def test_two_routers_at_once_give_the_same_order(redis_settings, rclient, keys):
    rng = random.Random(7)
    sent = [
        submit(rclient, keys, f"q{i}", 5, rng.randint(1, 30), priority=rng.choice([0, 1]), tenant=rng.choice("aab"))
        for i in range(30)
    ]
    routers = [make_router(redis_settings, rclient, name, read_batch=4) for name in ("r1", "r2")]
    for _ in range(5):  # each reads a share (no worker yet), 4 entries of each class's stream a step
        for router in routers:
            router.step()
    held = [[request.id for _, request in router.queue] for router in routers]
    assert sum(map(len, held)) == len(sent) and min(map(len, held)) >= 8
    model = vtc_model(sent, {})
    for ids in held:  # each router holds its share in the one order, whichever share it got
        assert ids == [i for i in model if i in set(ids)]
    publish_load(rclient, keys, "w1", max_total=BIG)
    threads = [threading.Thread(target=r.run) for r in routers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while rclient.xlen(keys.inbox("w1")) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    for router in routers:
        router.stop_event.set()
    for thread in threads:
        thread.join()
    got = inbox_ids(rclient, keys, "w1")
    assert sorted(got) == sorted(model)
    by_id = {r.id: r for r in sent}
    classes = [by_id[i].priority for i in got]
    assert classes == sorted(classes)  # no class-1 request overtook a class-0 one the other router held
    for ids in held:  # and each router sent its share in the order (the two shares interleave as they race)
        assert [i for i in got if i in set(ids)] == ids


def test_a_restarted_router_finds_its_entries_and_their_order(redis_settings, rclient, keys):
    sent = [submit(rclient, keys, f"q{i}", 5, 5, tenant="ab"[i % 3 == 0]) for i in range(12)]
    first = make_router(redis_settings, rclient, read_batch=5)
    for _ in range(3):
        first.step()  # all 12 read and tagged, in r1's pending list; then r1 dies without a word
    before = [request.id for _, request in first.queue]
    tags = rclient.zrange(keys.order(0), 0, -1, withscores=True)
    again = make_router(redis_settings, rclient, read_batch=5)  # same consumer name, fresh memory
    for _ in range(3):
        again.step()  # pages through its own pending list, 5 at a time
    assert [request.id for _, request in again.queue] == before == vtc_model(sent, {})
    assert rclient.zrange(keys.order(0), 0, -1, withscores=True) == tags  # tags found, not re-charged
    publish_load(rclient, keys, "w1", max_total=BIG)
    again.step()
    assert inbox_ids(rclient, keys, "w1") == before
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 0


def test_a_cancelled_queued_request_leaves_the_order(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "high", priority=0)
    submit(rclient, keys, "low", priority=1)
    router.step()
    rclient.set(keys.cancel("high"), 1)
    router._next_cancel_check = 0.0
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["low"]
    assert not rclient.exists(keys.waiting(None), keys.order(0), keys.tenant_queued())


def test_a_request_left_in_the_order_after_it_ended_does_not_block_lower_classes(redis_settings, rclient, keys):
    rclient.zadd(keys.waiting(None), {"ghost": 0})  # no status record: nothing will ever dispatch it
    rclient.zadd(keys.order(0), {"ghost": 0})
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "low", priority=1)
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()  # blocked by the ghost, which it finds ended and removes
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["low"]


def test_weights_are_checked():
    assert parse_weights("") == {} and parse_weights("a=2,b=.5") == {"a": 2.0, "b": 0.5}
    with pytest.raises(ValueError, match="must be > 0"):
        parse_weights("a=0")


def test_metrics_show_depth_per_class_and_tenant_and_tokens_served(redis_settings, rclient, keys):
    from prometheus_client import CollectorRegistry, generate_latest

    from router.metrics import RouterCollector
    from tests.monitoring.conftest import parse

    router = make_router(redis_settings, rclient)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    submit(rclient, keys, "a0", 10, 10, priority=0, tenant="a")
    submit(rclient, keys, "b0", 10, 10, priority=1, tenant="b")
    submit(rclient, keys, "b1", 10, 10, priority=1, tenant="b")
    publish_load(rclient, keys, "w1", max_total=25)  # room for one
    router.step()
    s = parse(generate_latest(registry).decode())
    assert s[("lightq:queue_class_depth", (("priority", "1"),))] == 2
    assert ("lightq:queue_class_depth", (("priority", "0"),)) not in s  # a0 went out
    assert s[("lightq:queue_tenant_depth", (("priority", "1"), ("tenant", "b")))] == 2
    assert s[("lightq:tenant_dispatched_tokens_total", (("priority", "0"), ("tenant", "a")))] == 20


def test_a_dead_routers_entries_keep_their_places_at_the_router_that_takes_them(redis_settings, rclient, keys):
    first = make_router(redis_settings, rclient, "r1", liveness_ttl_s=0.3)
    for i, (priority, tenant) in enumerate([(1, "a"), (0, "a"), (0, "a"), (0, "b")]):
        submit(rclient, keys, f"q{i}", 5, 5, priority=priority, tenant=tenant)
    first.step()  # reads and orders all four, then goes silent
    held = [request.id for _, request in first.queue]
    assert held == ["q1", "q3", "q2", "q0"]  # class 0 first; b's first request before a's second
    time.sleep(0.4)
    publish_load(rclient, keys, "w1", max_total=BIG)
    second = make_router(redis_settings, rclient, "r2", liveness_ttl_s=0.3)
    second.step()  # claims r1's entries (tags found in Redis, not charged again) and dispatches
    assert inbox_ids(rclient, keys, "w1") == held
    assert rclient.hgetall(keys.tenant_served()) == {
        class_tenant_field(1, "a"): "10",
        class_tenant_field(0, "a"): "20",
        class_tenant_field(0, "b"): "10",
    }


def test_reserved_slots_keep_room_for_the_default_class(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient, priority_reserve_slots=2)
    for i in range(4):
        submit(rclient, keys, f"low{i}", 5, 5, priority=1)
    publish_load(rclient, keys, "w1", max_total=BIG, running_max=4)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["low0", "low1"]  # two of the four slots stay free
    submit(rclient, keys, "high", 5, 5, priority=0)
    router.step()
    assert inbox_ids(rclient, keys, "w1") == ["low0", "low1", "high"]  # at once, no slot to wait for


def test_a_class_waits_only_for_better_classes_of_its_own_model(redis_settings, rclient, keys):
    # Records and router liveness that outlast a stall of the machine (it failed once in a loaded
    # full run, a-low not sent: a 5 s record gone between two steps, most likely).
    timing = dict(liveness_ttl_s=60.0, stale_load_s=60.0)
    first = make_router(redis_settings, rclient, "r1", **timing)
    second = make_router(redis_settings, rclient, "r2", **timing)
    submit(rclient, keys, "a-high", 5, 5, priority=0, model="a")
    first.step()  # r1 holds it; model a's worker is full
    submit(rclient, keys, "b-low", 5, 5, priority=1, model="b")
    submit(rclient, keys, "a-low", 5, 5, priority=1, model="a")
    second.step()  # r2 holds both low ones
    full = dict(max_total=BIG, running_max=1, requests=[(1, 0, 1, 1)], model="a", ttl_ms=60_000)
    publish_load(rclient, keys, "wa", **full)
    publish_load(rclient, keys, "wb", max_total=BIG, model="b", ttl_ms=60_000)
    second.step()
    assert inbox_ids(rclient, keys, "wb") == ["b-low"]  # b's pool is not held up by a's class 0
    publish_load(rclient, keys, "wa", max_total=BIG, model="a", ttl_ms=60_000)  # room on a's worker
    second.step()  # a-low waits behind a-high, which r1 holds
    assert inbox_ids(rclient, keys, "wa") == []
    first.step()
    second.step()
    assert inbox_ids(rclient, keys, "wa") == ["a-high", "a-low"]
