"""The admission rule on hand-made worker records (no Redis)."""

import pytest

from router.admission.views import Views
from router.workers.reservations import Reservations
from shared.admission import POLICIES, PastFuture, request_state, request_states
from shared.batch_view import Candidate
from shared.history import Estimator, OutputLengthHistory
from shared.peak import ReqState, check
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_load import WorkerLoad


def load(
    worker_id, max_total=100, committed=0, draining=False, last_inbox_id="0-0", requests=None, running_max=None, used=0
):
    """A record; without ``requests``, one request holding ``committed`` tokens with nothing left to add."""
    if requests is None:
        requests = [(committed, 0, 0, 0)] if committed else []
    return WorkerLoad(
        worker_id=worker_id,
        seq=1,
        ts_ms=0,
        max_total_tokens=max_total,
        used_tokens=used,
        committed_tokens=committed,
        num_running=0,
        num_waiting=0,
        draining=draining,
        last_inbox_id=last_inbox_id,
        requests=requests,
        running_max_req_size=running_max,
    )


def request(prompt=10, new=10, ignore_eos=False, resume=0):
    return GenerateRequest(
        id="r",
        prompt_ids=[1] * prompt,
        created_ms=0,
        resume_ids=[5] * resume,
        params=SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos),
    )


def estimator(history=(), prior=2048, seed=0):
    h = OutputLengthHistory(window=200, prior=prior)
    h.update(list(history))
    return Estimator(h, quantile=0.9, seed=seed)


def choose(loads, reserved, req, policy="conservative", est=None):
    """The router's choice (``Views``) for ``req`` among ``loads``, with ``reserved`` on top."""
    views = Views(POLICIES[policy](est or estimator(), 0.05))
    views.refresh(loads, reserved)
    return views.choose(Candidate(request_states(req), views.policy), req.model)


def test_request_state_counts_resumed_tokens_as_held_and_generated():
    assert request_state(request(10, 50, resume=4)) == ReqState(14, 4, 50, 0)
    assert request_state(request(10, 50, ignore_eos=True)) == ReqState(10, 0, 50, 1)


def test_conservative_check_counts_prompt_plus_max_new_tokens():
    r = request(10, 10)
    assert choose({"a": load("a", max_total=20)}, {}, r) == "a"
    assert choose({"a": load("a", max_total=20)}, {"a": [ReqState(1, 0, 0, 0)]}, r) is None
    assert choose({"a": load("a", max_total=100, committed=81)}, {}, r) is None
    assert choose({"a": load("a", draining=True)}, {}, r) is None
    # published summaries give the same sum: 30 + 40 + 20 = 90 <= 100, one more token would not fit
    busy = [(20, 5, 15, 0), (40, 0, 0, 0)]
    assert choose({"a": load("a", requests=busy)}, {}, r) == "a"
    assert choose({"a": load("a", requests=[*busy, (11, 0, 0, 0)])}, {}, r) is None


def test_least_loaded_admissible_worker_wins():
    loads = {"a": load("a", committed=50), "b": load("b", committed=10), "c": load("c", committed=0)}
    held = lambda n: [ReqState(n, 0, 0, 0)]  # noqa: E731 - a reservation of n tokens
    assert choose(loads, {"c": held(95)}, request()) == "b"
    assert choose(loads, {"b": held(80), "c": held(95)}, request()) == "a"
    assert choose(loads, {"a": held(50), "b": held(90), "c": held(95)}, request()) is None


def packed(policy, req, history=(), pool=10_000, prior=2048):
    """How many copies of ``req`` one empty worker takes, each reserved as it is dispatched."""
    loads, reserved, est = {"a": load("a", max_total=pool, requests=[])}, {"a": []}, estimator(history, prior)
    while choose(loads, reserved, req, policy, est) == "a":
        reserved["a"].append(request_state(req))
    return len(reserved["a"])


def test_past_future_admits_more_when_history_says_outputs_are_short():
    req = request(prompt=100, new=900)  # conservative need 1000: 10 fit in 10,000
    short = [50] * 150 + [100] * 50
    assert packed("conservative", req) == 10
    assert packed("past_future", req, short) > 40
    assert packed("past_future_quantile", req, short) == 47  # every output at p90 = 100: 9,500 / 200
    # with no history yet the prior (above max_new_tokens) makes past-future as careful as conservative
    assert packed("past_future", req) <= 10


def test_past_future_admits_fewer_for_ignore_eos_with_large_max_new_tokens():
    short = [50] * 200
    eos = request(prompt=100, new=900)
    exact = request(prompt=100, new=900, ignore_eos=True)
    assert packed("past_future", exact, short) < packed("past_future", eos, short)
    # lengths known exactly: every request holds 1000 at the end, within pool * (1 - 0.05)
    assert packed("past_future", exact, short) == packed("past_future_quantile", exact, short) == 9


def test_peak_counts_running_requests_that_finish_early():
    # a worker 800 tokens from full, by the conservative sum; but its request is nearly done
    running = [(790, 780, 800, 1)]  # ignore_eos: exactly 20 more tokens, then it frees 810
    loads = {"a": load("a", max_total=1000, requests=running)}
    req = request(prompt=100, new=400, ignore_eos=True)  # peak 810 + 120 = 930 < 950
    assert choose(loads, {}, req, "conservative") is None
    assert choose(loads, {}, req, "past_future") == "a"


def test_request_count_cap_and_draining():
    req = request(1, 1)
    full = load("a", max_total=10_000, requests=[(2, 0, 1, 0)] * 3, running_max=4)
    assert choose({"a": full}, {}, req, "past_future") == "a"
    assert choose({"a": full}, {"a": [request_state(req)]}, req, "past_future") is None
    drained = load("a", max_total=10_000, requests=[], draining=True)
    assert choose({"a": drained}, {}, req, "past_future") is None


def test_aggressive_looks_only_at_tokens_held_now():
    req = request(prompt=10, new=10_000)
    assert choose({"a": load("a", max_total=100, requests=[(84, 0, 9_999, 0)])}, {}, req, "aggressive") == "a"
    assert choose({"a": load("a", max_total=100, requests=[(86, 0, 1, 0)])}, {}, req, "aggressive") is None


def test_lowest_resulting_peak_ratio_wins_across_pool_sizes():
    req = request(10, 10, ignore_eos=True)
    loads = {
        "big": load("big", max_total=1000, requests=[(400, 0, 100, 1)]),  # (500 + 20) / 1000
        "small": load("small", max_total=100, requests=[]),
    }  # 20 / 100
    assert choose(loads, {}, req, "past_future") == "small"
    assert choose(loads, {"small": [ReqState(50, 0, 0, 1)]}, req, "past_future") == "big"


def test_check_returns_the_ratio_or_none():
    est = estimator()
    states = [ReqState(10, 0, 10, 1)]
    assert check(states, ReqState(10, 0, 10, 1), 100, None, PastFuture(est, 0.05)) == pytest.approx(0.4)
    assert check(states, ReqState(10, 0, 10, 1), 100, 1, PastFuture(est, 0.05)) is None


def test_reservations_settle_when_the_worker_reports_the_entry():
    res = Reservations()
    res.add("a", "5-0", request(10, 10))
    res.add("a", "7-0", request(10, 20))
    res.settle({"a": load("a", last_inbox_id="5-0")})
    assert res.tokens() == {"a": 30}
    assert res.pending() == {"a": [ReqState(10, 0, 20, 0)]}
    res.settle({"a": load("a", last_inbox_id="7-0")})
    assert res.tokens() == {} and res.pending() == {}


def test_reservations_of_a_vanished_worker_are_dropped():
    res = Reservations()
    res.add("a", "5-0", request(10, 10))
    res.settle({})
    assert res.pending() == {} and res.tail("a") == "0-0"


def test_the_tail_is_the_newest_inbox_entry_accounted_for():
    res = Reservations()
    res.settle({"a": load("a", last_inbox_id="3-0")})
    assert res.tail("a") == "3-0"  # the record covers everything up to its id
    res.learn("a", [("4-0", request(10, 10)), ("6-0", request(20, 10))])  # another router's
    res.add("a", "8-0", request(30, 10))  # ours
    assert res.tail("a") == "8-0" and res.tokens() == {"a": 90}  # (10 + 10) + (20 + 10) + (30 + 10)
    res.settle({"a": load("a", last_inbox_id="9-0")})  # the worker took entries we never saw, too
    assert res.tail("a") == "9-0" and res.pending() == {}


def test_what_a_better_class_may_pause_counts_requests_sent_since_the_record():
    """The record's ``preemptible`` lags admission by up to a heartbeat; the router adds what it
    (or another router) sent since, except a request sending prompt logprobs and one paused
    --max_preemptions times already. A group counts whole: its prompt once, a slot per sample."""
    res = Reservations()
    record = load("a", last_inbox_id="3-0").model_copy(update={"preemptible": [(1, 40, 2)], "max_preemptions": 2})
    res.settle({"a": record})

    def sent(priority, prompt=10, preemptions=0, n=1, **params):
        msg = request(prompt, 10)
        sampling = msg.params.model_copy(update=params)
        return msg.model_copy(update={"priority": priority, "preemptions": preemptions, "n": n, "params": sampling})

    res.add("a", "4-0", sent(1, prompt=5))
    res.add("a", "5-0", sent(2, prompt=7))
    res.add("a", "6-0", sent(2, preemptions=2))  # paused twice already: not again
    res.add("a", "7-0", sent(2, n=2))  # a group: 10 tokens (its prompt), 2 slots
    res.add("a", "8-0", sent(2, prompt_logprobs=1))
    res.add("a", "9-0", sent(0))
    assert res.preemptible({"a": record}) == {"a": [(2, 7 + 10, 1 + 2), (1, 45, 3), (0, 10, 1)]}
    res.settle({"a": record.model_copy(update={"last_inbox_id": "5-0"})})  # the record shows 4-0 and 5-0 now
    assert res.preemptible({"a": record}) == {"a": [(2, 10, 2), (1, 40, 2), (0, 10, 1)]}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_what_a_worker_says_one_request_may_need_the_router_always_starts_alone(name):
    """A worker's record carries its policy's ``limit`` of its pool (``admission_limit``), the
    producer's bound at the door: every request within it must start on an empty worker whatever
    the history says (one the door let through and the router refused was a 200 and then an
    error: red team 3), and for the conservative policy one past it never starts. (For the
    aggressive one the bound is stricter than it must be: past its watermark only the prompt
    matters, which one number at the door cannot say.)"""
    policy = POLICIES[name](estimator(prior=2048), 0.05)
    pool = 1000
    limit = int(policy.limit(pool))
    assert limit == {"conservative": 1000}.get(name, 950)  # the margin, or the aggressive watermark
    empty = WorkerLoad(
        worker_id="w",
        seq=1,
        ts_ms=0,
        max_total_tokens=pool,
        used_tokens=0,
        committed_tokens=0,
        num_running=0,
        num_waiting=0,
        requests=[],
        admission_limit=limit,
    )
    views = Views(policy)
    views.refresh({"w": empty}, {})
    for prompt in (1, 10, limit // 2, limit - 1):
        msg = GenerateRequest(
            id="r", prompt_ids=[1] * prompt, params=SamplingParams(max_new_tokens=limit - prompt), created_ms=0
        )
        assert msg.max_tokens_needed == limit
        assert not views.fits_nowhere(msg, request_states(msg)), (name, prompt)
    over = GenerateRequest(id="o", prompt_ids=[1] * 10, params=SamplingParams(max_new_tokens=pool - 9), created_ms=0)
    if name == "conservative":
        assert views.fits_nowhere(over, request_states(over))
