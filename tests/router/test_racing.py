"""Two real routers racing to fill one worker: neither may over-admit it.

The worker publishes one load record and never takes its inbox, so the only
thing that can stop the routers is what they know of each other's
dispatches. Each router reads part of the burst (``read_batch`` is half the
burst, and a router holds at most that many), so each has requests it would
dispatch if it knew only of its own.
"""

import threading

import pytest

from router.loop import Router
from router.workers.registry import read_registry
from shared.admission import POLICIES, request_state
from shared.codec import entry, from_entry
from shared.config import AdmissionSettings, RouterSettings
from shared.history import Estimator, OutputLengthHistory
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group
from shared.schemas import GenerateRequest, SamplingParams
from tests.router.helpers import finished_lengths, inbox_ids, publish_load, submit

POOL = 1000
BURST = 40


def drive(router: Router, start: threading.Barrier, errors: list) -> None:
    """Step until every entry was delivered and a step of ours dispatched nothing.

    The fake worker never frees room and what a router knows of the others only
    grows, so a router that once stalls with nothing left to read stays stalled.
    """
    try:
        start.wait()
        while not router.stop_event.is_set():  # set by the test only if we hang
            dispatched = router.step()
            pending = router.client.xpending(router.keys.requests(), ROUTER_GROUP)["pending"]
            delivered = pending + router.client.xlen(router.keys.inbox("w1"))
            if dispatched == 0 and delivered == BURST:
                return
    except Exception as exc:  # surfaced by the test thread
        errors.append(exc)


@pytest.mark.parametrize("policy, ignore_eos", [("conservative", False), ("past_future", True)])
def test_two_routers_never_over_admit_one_worker(redis_settings, rclient, keys, policy, ignore_eos):
    publish_load(rclient, keys, "w1", max_total=POOL, requests=[], running_max=256, ttl_ms=600_000)
    finished_lengths(rclient, keys, [20] * 200)
    for i in range(BURST):
        submit(rclient, keys, f"q{i}", 50, 50, ignore_eos=ignore_eos)
    settings = RouterSettings(
        redis=redis_settings,
        poll_ms=5,
        read_batch=20,
        stale_load_s=600,
        admission_rule=AdmissionSettings(admission=policy),
    )
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    routers = [
        Router(settings, rclient.__class__.from_url(redis_settings.url, decode_responses=True), name)
        for name in ("r1", "r2")
    ]
    start, errors = threading.Barrier(2), []
    threads = [threading.Thread(target=drive, args=(r, start, errors)) for r in routers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for r in routers:
        r.stop_event.set()
    assert not any(t.is_alive() for t in threads) and not errors, errors

    dispatched = [request_state(from_entry(GenerateRequest, f)) for _, f in rclient.xrange(keys.inbox("w1"))]
    estimator = Estimator(OutputLengthHistory(200, prior=50), seed=0)  # exact lengths: the history is unused
    admission = POLICIES[policy](estimator, routers[0].rule.settings.admission_margin)
    assert admission.use(dispatched) <= admission.limit(POOL)
    allowed = 10 if policy == "conservative" else 9  # 100 tokens each; past-future: 950 after the margin
    assert len(dispatched) == allowed  # and the routers did fill the worker
    assert sum(len(r.queue) for r in routers) == BURST - allowed


def test_a_router_learns_the_other_routers_dispatches_and_decides_again(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=300, requests=[])
    publish_load(rclient, keys, "w2", max_total=300, requests=[])
    settings = RouterSettings(
        redis=redis_settings, poll_ms=5, read_batch=2, admission_rule=AdmissionSettings(admission="conservative")
    )
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    r1, r2 = (Router(settings, rclient, name) for name in ("r1", "r2"))
    for i in range(4):
        submit(rclient, keys, f"q{i}", 50, 50)  # 100 each: 3 fit a worker
    r1.step()  # q0 -> w1, q1 -> w2
    # r2 knows neither: its run q2 -> w1, q3 -> w2 is refused, q0 and q1 handed back; with
    # both learnt, q2 -> w1 (tie, first by id) goes, and q3 -> w2, the less used
    r2.step()
    assert inbox_ids(rclient, keys, "w1") == ["q0", "q2"] and inbox_ids(rclient, keys, "w2") == ["q1", "q3"]
    assert r2.reservations.tokens() == {"w1": 200, "w2": 200}


def test_no_dispatch_to_a_worker_whose_record_expired_after_the_registry_read(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", requests=[])
    router = Router(RouterSettings(redis=redis_settings, poll_ms=5), rclient, "r1")
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    submit(rclient, keys, "q0")
    router.intake.read()
    loads = read_registry(rclient, keys).live
    rclient.delete(keys.load("w1"))  # w1 dies: the janitor may be emptying its inbox right now
    assert router._dispatch(loads) == 0
    assert not rclient.exists(keys.inbox("w1")) and len(router.queue) == 1


def test_a_run_of_decisions_goes_in_one_round_trip_and_a_refused_one_keeps_its_order(redis_settings, rclient, keys):
    publish_load(rclient, keys, "w1", max_total=10_000, requests=[])
    router = Router(
        RouterSettings(
            redis=redis_settings, poll_ms=5, read_batch=8, admission_rule=AdmissionSettings(admission="conservative")
        ),
        rclient,
        "r1",
    )
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    calls = []
    send_many = router.dispatcher.send_many
    router.dispatcher.send_many = lambda items: calls.append([i.request.id for i in items]) or send_many(items)
    for i in range(3):
        submit(rclient, keys, f"q{i}")
    other = GenerateRequest(
        id="other", prompt_ids=list(range(1, 11)), params=SamplingParams(max_new_tokens=10), created_ms=0
    )
    rclient.xadd(keys.inbox("w1"), entry(other))  # another router's dispatch, unknown to this one
    assert router.step() == 3
    # The first run's q0 met the other router's entry; q1 and q2 behind it were not tried.
    assert calls == [["q0", "q1", "q2"], ["q0", "q1", "q2"]]
    assert inbox_ids(rclient, keys, "w1") == ["other", "q0", "q1", "q2"]
    assert router.reservations.tokens() == {"w1": 4 * 20}


def test_a_second_entry_of_a_request_an_inbox_holds_is_dropped(redis_settings, rclient, keys):
    """A copy a crash left on the ingress (a requeue repeated) never reaches a second inbox: one
    worker holds a request, with the one live epoch; the copy is acknowledged and leaves the order."""
    publish_load(rclient, keys, "w1", max_total=1000, requests=[])
    publish_load(rclient, keys, "w2", max_total=1000, requests=[])
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    router = Router(RouterSettings(redis=redis_settings, poll_ms=5), rclient, "r1")
    msg = submit(rclient, keys, "q0", 50, 50)
    router.step()
    assert inbox_ids(rclient, keys, "w1") + inbox_ids(rclient, keys, "w2") == ["q0"]
    assert rclient.hget(keys.meta("q0"), "epoch") == "1"
    rclient.xadd(keys.requests(), entry(msg))  # the copy
    router.step()
    assert inbox_ids(rclient, keys, "w1") + inbox_ids(rclient, keys, "w2") == ["q0"]
    assert rclient.xpending(keys.requests(), ROUTER_GROUP)["pending"] == 0 and not router.queue
    assert rclient.hget(keys.meta("q0"), "epoch") == "1"
    assert rclient.zcard(keys.order(0)) == 0 and rclient.zcard(keys.waiting(None)) == 0
