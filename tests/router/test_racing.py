"""Two real routers racing to fill one worker: neither may over-admit it.

The worker publishes one load record and never takes its inbox, so the only
thing that can stop the routers is what they know of each other's
dispatches. Each router reads part of the burst (``read_batch`` is smaller
than the burst), so each has requests it would dispatch if it knew only of
its own.
"""

import threading

import pytest

from router.admission import request_state
from router.loop import Router
from shared.codec import from_entry
from shared.config import AdmissionSettings, RouterSettings
from shared.history import Estimator, OutputLengthHistory
from shared.keys import ROUTER_GROUP
from shared.peak import projected_use, use_limit
from shared.redis import ensure_group
from shared.schemas import GenerateRequest
from tests.router.helpers import finished_lengths, publish_load, submit

POOL = 1000
BURST = 40


def drive(router: Router, start: threading.Barrier, errors: list) -> None:
    """Step until every entry was delivered and a step of ours dispatched nothing.

    The fake worker never frees room and what a router knows of the others only
    grows, so a router that once stalls with nothing left to read stays stalled.
    """
    try:
        start.wait()
        while True:
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
    settings = RouterSettings(redis=redis_settings, poll_ms=5, read_batch=15, stale_load_s=600,
                              past_future=AdmissionSettings(admission=policy))
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    routers = [Router(settings, rclient.__class__.from_url(redis_settings.url, decode_responses=True), name)
               for name in ("r1", "r2")]
    start, errors = threading.Barrier(2), []
    threads = [threading.Thread(target=drive, args=(r, start, errors)) for r in routers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not errors, errors

    dispatched = [request_state(from_entry(GenerateRequest, f)) for _, f in rclient.xrange(keys.inbox("w1"))]
    estimator = Estimator(OutputLengthHistory(200, prior=50), seed=0)  # exact lengths: the history is unused
    margin = routers[0].rule.margin
    assert projected_use(dispatched, policy, estimator) <= use_limit(POOL, policy, margin)
    allowed = 10 if policy == "conservative" else 9  # 100 tokens each; past-future: 950 after the margin
    assert len(dispatched) == allowed  # and the routers did fill the worker
    assert sum(len(r.queue) for r in routers) == BURST - allowed
