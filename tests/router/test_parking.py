"""One tenant's flood longer than ``--order_window`` no longer hides another tenant's request behind
it (``router.order.parking``): the router reads past its window, parks the flood's entries beyond the
tenant's share of the queue, and brings them back in order as the share frees (real Redis)."""

from router.loop import Router
from shared.config import RouterSettings
from tests.router.helpers import inbox_ids, publish_load, submit

FLOOD = 60


def make_router(redis_settings, rclient, name="r1"):
    settings = RouterSettings(redis=redis_settings, poll_ms=10, order_window=16, read_batch=16)
    return Router(settings, rclient, name)


def flood_then_quiet(rclient, keys) -> None:
    for i in range(FLOOD):
        submit(rclient, keys, f"flood-{i:02d}", tenant="flood")
    submit(rclient, keys, "quiet", tenant="quiet")


def drain(router, rclient, keys, steps: int = 40) -> list[str]:
    publish_load(rclient, keys, "w1", max_total=100_000, running_max=1000)
    for _ in range(steps):
        router.step()
    return inbox_ids(rclient, keys, "w1")


def test_a_request_behind_a_flood_longer_than_the_window_gets_its_fair_place(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    flood_then_quiet(rclient, keys)
    for _ in range(5):  # no worker yet: 16 entries a read, the whole backlog read and ordered
        router.step()
    assert router.parking.count == FLOOD - router.parking.per_tenant  # all but the flood's share
    publish_load(rclient, keys, "w1", max_total=45)  # room for two requests of 20 tokens
    router.step()
    # Before: the router held the window's 16 flood entries and read no further; "quiet" came
    # after the whole flood had been dispatched.
    assert "quiet" in inbox_ids(rclient, keys, "w1")[:2]


def test_parked_entries_come_back_in_order_each_once_and_after_a_restart(redis_settings, rclient, keys):
    router = make_router(redis_settings, rclient)
    flood_then_quiet(rclient, keys)
    for _ in range(5):
        router.step()
    assert router.parking.count > 0
    restarted = make_router(redis_settings, rclient)  # the same name: reads its pending entries again
    sent = drain(restarted, rclient, keys)
    assert sorted(sent) == sorted([f"flood-{i:02d}" for i in range(FLOOD)] + ["quiet"])  # each once
    flood = [i for i in sent if i.startswith("flood")]
    assert flood == sorted(flood)  # the tenant's own order kept
    assert restarted.parking.count == 0 and not rclient.xpending(keys.requests(), "routers")["pending"]


def test_entries_handed_out_in_an_outage_are_parked_again_first():
    """``due`` pops entries to read back; an outage before they are read must not lose them (they
    are in this router's pending list alone) nor reorder the tenant's."""
    from router.order.parking import Parked, Parking

    parking = Parking(order_window=4)  # one a tenant in the queue
    entries = [Parked(f"{i}-0", float(i), f"r{i}", 0, None, "t") for i in range(3)]
    for entry in entries:
        parking.park(entry)
    due = parking.due(lambda priority, tenant: 0)
    assert due == entries[:1] and parking.count == 2
    parking.restore(due)
    assert parking.count == 3 and parking.due(lambda priority, tenant: 0) == entries[:1]
