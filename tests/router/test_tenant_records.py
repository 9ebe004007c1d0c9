"""Per-tenant state stays bounded (issue 34 item 2), against a real Redis and the real router: a
fair-share record is dropped only when that changes no tag (the same requests get the same tags
and go out in the same order with and without the drops), a class past ``--max_tenants`` charges
new tenants to ``other`` (alike when a router reads the request again), and idle tenants'
counters fold into ``other`` without losing a token."""

from __future__ import annotations

import random

import pytest

from router.loop import Router
from router.order.ordering import cost
from shared.config import RedisSettings, RouterSettings
from shared.keys import ROUTER_GROUP, class_tenant_field
from shared.redis import ensure_group
from shared.schemas import OTHER_TENANT
from tests.router.helpers import inbox_ids, publish_load, submit

BIG = 10**9


def make_router(redis_settings, rclient, name="r1", **settings) -> Router:
    # A long liveness period: housekeeping (and with it the compaction pass) runs once, at the
    # first step, unless a test calls ``compact`` itself.
    settings = {"poll_ms": 10, "liveness_ttl_s": 3600.0, **settings}
    router = Router(RouterSettings(redis=redis_settings, **settings), rclient, name)
    ensure_group(rclient, router.keys.requests(), ROUTER_GROUP)
    return router


class Recorded:
    """The tags a router's tagger hands out, by request id."""

    def __init__(self, router: Router):
        self.tags: dict[str, float] = {}
        inner = router.tagger.tags

        def tags(requests):
            out = inner(requests)
            self.tags.update((r.id, tag) for tag, r in out)
            return out

        router.tagger.tags = tags


def play(rclient, redis_settings: RedisSettings, seed: int, compact: bool) -> tuple[dict, list, int]:
    """Rounds of new requests from a few tenants (who come and go) against a worker with room for
    3 requests a round: some wait, some tenants have work queued across rounds, the class's
    virtual time moves. Returns the tags, the inbox order and the records dropped."""
    rng = random.Random(seed)
    keys = redis_settings.keys
    router = make_router(redis_settings, rclient)
    recorded, dropped = Recorded(router), 0
    tail = "0-0"
    for round_ in range(30):
        active = rng.sample("abcdefgh", rng.randint(1, 4))
        for i in range(rng.randint(0, 4)):
            tenant = rng.choice(active)
            submit(rclient, keys, f"q{round_}-{i}", rng.randint(1, 30), rng.randint(1, 30), tenant=tenant)
        publish_load(rclient, keys, "w1", max_total=BIG, running_max=3, last_inbox_id=tail)
        router.step()
        entries = rclient.xrevrange(keys.inbox("w1"), count=1)
        tail = entries[0][0] if entries else tail
        if compact:
            dropped += router.tenant_records.compact().dropped
    return recorded.tags, inbox_ids(rclient, keys, "w1"), dropped


@pytest.mark.parametrize("seed", range(3))
def test_dropping_records_changes_no_tag(redis_settings, rclient, seed):
    plain = redis_settings.model_copy(update={"key_prefix": f"{redis_settings.key_prefix}:plain"})
    compacted = redis_settings.model_copy(update={"key_prefix": f"{redis_settings.key_prefix}:compacted"})
    tags, order, _ = play(rclient, plain, seed, compact=False)
    tags_c, order_c, dropped = play(rclient, compacted, seed, compact=True)
    assert dropped > 0  # the drops happened, and were invisible:
    assert tags_c == tags and order_c == order
    assert len(tags) > 40 and len(order) > 40
    # Without drops every tenant keeps a record; with them, fewer remain.
    assert rclient.hlen(compacted.keys.vtc(0)) < rclient.hlen(plain.keys.vtc(0))


def test_a_returning_tenant_starts_at_the_class_virtual_time(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    recorded = Recorded(router)
    publish_load(rclient, keys, "w1", max_total=BIG)
    submit(rclient, keys, "a0", 10, 10, tenant="a")  # a's record: F = 20
    router.step()
    for i in range(3):  # b's tags 0, 20, 40: the virtual time reaches 40, past a's F
        submit(rclient, keys, f"b{i}", 10, 10, tenant="b")
    router.step()
    assert float(rclient.hget(keys.vtime(), "0")) == 40.0
    assert router.tenant_records.compact().dropped == 1  # a's (F = 20 <= 40); b's F = 60 stays
    assert rclient.hgetall(keys.vtc(0)) == {"b": "60"}
    submit(rclient, keys, "a1", 10, 10, tenant="a")
    router.step()
    assert recorded.tags["a1"] == 40.0  # max(V, F) = max(40, 20) = 40 = max(40, no record)


def test_a_tenant_with_queued_requests_keeps_its_record(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    submit(rclient, keys, "a0", 10, 10, tenant="a")
    router.step()  # tagged; no worker: queued
    rclient.hset(keys.vtime(), "0", 1000)  # as if other requests had gone out far past a's F
    assert router.tenant_records.compact().dropped == 0
    assert rclient.hget(keys.vtc(0), "a") == "20"


def test_new_tenants_past_the_cap_are_charged_to_other(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient, max_tenants=2, tenant_weights="vip=2")
    for i, tenant in enumerate(["a", "b", "c", "d", "a", "vip", "default"]):
        submit(rclient, keys, f"q{i}", 10, 10, tenant=tenant)
    router.step()
    charged = {request.id: request.tenant for _, request in router.queue}
    assert charged == {"q0": "a", "q1": "b", "q2": OTHER_TENANT, "q3": OTHER_TENANT, "q4": "a"} | {
        "q5": "vip",  # named in --tenant_weights: always a record of its own
        "q6": "default",
    }
    assert rclient.hget(keys.meta("q2"), "charged_to") == OTHER_TENANT
    assert rclient.hget(keys.meta("q0"), "charged_to") is None
    assert set(rclient.hgetall(keys.vtc(0))) == {"a", "b", OTHER_TENANT, "vip", "default"}
    assert rclient.hgetall(keys.tenant_queued())[class_tenant_field(0, OTHER_TENANT)] == "2"
    publish_load(rclient, keys, "w1", max_total=BIG)
    router.step()
    assert not rclient.exists(keys.tenant_queued())  # every count went back to 0: nothing leaked
    served = rclient.hgetall(keys.tenant_served())
    assert served[class_tenant_field(0, OTHER_TENANT)] == "40" and class_tenant_field(0, "c") not in served


def test_a_router_that_reads_a_request_again_charges_it_alike(redis_settings, rclient, keys):
    first = make_router(redis_settings, rclient, max_tenants=1)
    submit(rclient, keys, "a0", 10, 10, tenant="a")
    submit(rclient, keys, "c0", 10, 10, tenant="c")
    first.step()  # a has the one record; c0 is charged to other; then first dies without a word
    assert [r.tenant for _, r in first.queue] == ["a", OTHER_TENANT]
    rclient.delete(keys.vtc(0))  # room again...
    submit(rclient, keys, "c1", 10, 10, tenant="c")
    again = make_router(redis_settings, rclient, max_tenants=1)  # same consumer name, fresh memory
    again.step()  # its own pending entries first: c0, read again, stays charged to other
    again.step()  # ...while c1, new, gets c a record of its own
    assert {r.id: r.tenant for _, r in again.queue} == {"a0": "a", "c0": OTHER_TENANT, "c1": "c"}
    publish_load(rclient, keys, "w1", max_total=BIG)
    again.step()
    assert sorted(inbox_ids(rclient, keys, "w1")) == ["a0", "c0", "c1"]
    assert not rclient.exists(keys.tenant_queued())  # each count taken back where it was added


def test_idle_tenants_counters_fold_into_other_without_losing_tokens(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient, max_tenants=3)
    sent, folded = [], 0
    for i, tenant in enumerate(["a", "a", "a", "b", "b", "c", "d", "e", "f"]):  # one at a time: V moves
        sent.append(submit(rclient, keys, f"q{i}", 10 + i, 10, tenant=tenant))
        publish_load(rclient, keys, "w1", max_total=BIG, last_inbox_id=_tail(rclient, keys))
        router.step()
        served = {k: int(v) for k, v in rclient.hgetall(keys.tenant_served()).items()}
        assert sum(served.values()) == sum(cost(r) for r in sent)  # folding loses no token
        folded += router.tenant_records.compact().folded  # records whose F the virtual time passed go
        after = {k: int(v) for k, v in rclient.hgetall(keys.tenant_served()).items()}
        assert sum(after.values()) == sum(served.values()) and len(after) <= 3 + 1
    assert folded > 0 and class_tenant_field(0, OTHER_TENANT) in after
    submit(rclient, keys, "busy", 10, 10, tenant="b")
    publish_load(
        rclient, keys, "w1", max_total=100, committed=95, last_inbox_id=_tail(rclient, keys)
    )  # no room: it waits
    router.step()
    rclient.hset(keys.vtime(), "0", 10**6)  # as if others had gone out far past every F
    router.tenant_records.compact()
    assert list(rclient.hgetall(keys.vtc(0))) == ["b"]  # b has work queued: it keeps its record


def _tail(rclient, keys) -> str:
    entries = rclient.xrevrange(keys.inbox("w1"), count=1)
    return entries[0][0] if entries else "0-0"
