"""The router's prepared worker views give the answers of ``shared.peak.check`` from scratch
(no Redis), for single requests and groups."""

import random

import pytest

from bench.sim.router_bench import choose_by_check
from router.admission.views import Views
from router.admission.worker_view import WorkerView
from shared.admission import AdmissionRule, request_state, request_states
from shared.batch_view import Candidate
from shared.config import AdmissionSettings
from shared.history import Estimator
from shared.peak import ReqState, check
from tests.router.test_admission import load, request

POLICIES = ["conservative", "aggressive", "past_future_quantile", "past_future"]


def rule(policy, rng):
    r = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    r.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    return r


def check_worker(record, reserved, req, policy):
    """The reference: ``check`` on one worker's record plus the dispatches it does not show yet."""
    if record.draining:
        return None
    states = [ReqState(*r) for r in record.requests] + list(reserved)
    return check(states, request_states(req), record.max_total_tokens, record.running_max_req_size, policy)


def random_case(rng):
    """A worker record (sometimes draining, or with a request cap), reservations, a request (sometimes a group)."""
    states = [
        (p + g, g, m, int(rng.random() < 0.3))
        for p, m in ((rng.randint(1, 300), rng.randint(1, 400)) for _ in range(rng.randint(0, 40)))
        for g in [rng.randint(0, m)]
    ]
    record = load(
        "w",
        max_total=rng.choice([2000, 8000, 20000]),
        draining=rng.random() < 0.05,
        requests=states,
        running_max=rng.choice([None, 10, 45]),
    )
    reserved = [
        request_state(request(rng.randint(1, 300), rng.randint(1, 400), rng.random() < 0.3, rng.randint(0, 5)))
        for _ in range(rng.randint(0, 4))
    ]
    req = request(rng.randint(1, 300), rng.randint(1, 400), rng.random() < 0.3, rng.randint(0, 5))
    if rng.random() < 0.25:  # a group of 2 to 4 samples (no resume_ids: a group resumes per choice)
        req = req.model_copy(update={"n": rng.randint(2, 4), "resume_ids": []})
    return record, reserved, req


@pytest.fixture
def same_draws(monkeypatch):
    """Past-future's draws as a function of the state alone: the view draws them once per
    view and ``check`` once per call, in other orders; with this both see the same lengths."""

    def remaining(self, s):
        return self._remaining(s, ((s.held * 7919 + s.generated * 104729 + s.max_new_tokens) % 1000) / 1000)

    monkeypatch.setattr(Estimator, "remaining_sampled", remaining)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(40))
def test_a_view_answers_as_check_worker(policy, seed, same_draws):
    rng = random.Random(seed)
    r = rule(policy, rng)
    for _ in range(5):
        record, reserved, req = random_case(rng)
        view = WorkerView(record, reserved[:2], r.policy)
        view.add(reserved[2:])  # dispatched after the view was built
        expected = check_worker(record, reserved, req, r.policy)
        assert view.ratio(Candidate(request_states(req), r.policy)) == expected


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(10))
def test_a_view_that_admitted_a_group_answers_as_check_worker(policy, seed, same_draws):
    """A group admitted on a view counts every sample (its prompt once) for the next question."""
    rng = random.Random(seed)
    r = rule(policy, rng)
    record, reserved, _ = random_case(rng)
    record = record.model_copy(update={"draining": False, "max_total_tokens": 10**6})
    view, counted = WorkerView(record, reserved, r.policy), list(reserved)
    for _ in range(4):
        group = request(rng.randint(1, 300), rng.randint(1, 400)).model_copy(update={"n": rng.randint(2, 4)})
        candidate = Candidate(request_states(group), r.policy)
        assert view.ratio(candidate) == check_worker(record, counted, group, r.policy)
        view.admit(candidate)
        counted += request_states(group)
        assert view.use() == r.policy.use([ReqState(*s) for s in record.requests] + counted)


def test_the_views_choose_what_the_check_from_scratch_chooses(same_draws):
    rng = random.Random(7)
    r = rule("past_future", rng)
    for _ in range(50):
        cases = [random_case(rng) for _ in range(6)]
        loads = {f"w{i}": c[0].model_copy(update={"worker_id": f"w{i}"}) for i, c in enumerate(cases)}
        reserved = {f"w{i}": c[1] for i, c in enumerate(cases)}
        req = cases[0][2]
        views = Views(r.policy)
        views.refresh(loads, reserved)
        assert views.choose(Candidate(request_states(req), r.policy)) == choose_by_check(loads, reserved, req, r.policy)


def test_a_group_counts_its_prompt_once():
    group = request(100, 10).model_copy(update={"n": 3})
    states = request_states(group)
    assert len(states) == 3 and sum(s.conservative_need for s in states) == 100 + 3 * 10
    r = AdmissionRule(AdmissionSettings(admission="conservative"))
    assert check_worker(load("w", max_total=130, requests=[]), [], group, r.policy) == 1.0
    assert check_worker(load("w", max_total=129, requests=[]), [], group, r.policy) is None
    assert WorkerView(load("w", max_total=130, requests=[]), [], r.policy).ratio(Candidate(states, r.policy)) == 1.0
    assert WorkerView(load("w", max_total=129, requests=[]), [], r.policy).ratio(Candidate(states, r.policy)) is None
