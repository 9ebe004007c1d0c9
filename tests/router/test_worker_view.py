"""The router's prepared worker views give ``check_worker``'s answers (no Redis)."""

import random

import pytest

from router.admission import check_worker, choose_view, choose_worker, request_state, request_states
from router.worker_view import Candidate, Views, WorkerView
from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.history import Estimator
from tests.router.test_admission import load, request

POLICIES = ["conservative", "aggressive", "past_future_quantile", "past_future"]


def rule(policy, rng):
    r = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    r.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    return r


def random_case(rng):
    """A worker record (sometimes without summaries, draining, or a request cap), reservations, a request."""
    states = [(p + g, g, m, int(rng.random() < 0.3))
              for p, m in ((rng.randint(1, 300), rng.randint(1, 400)) for _ in range(rng.randint(0, 40)))
              for g in [rng.randint(0, m)]]
    record = load("w", max_total=rng.choice([2000, 8000, 20000]), committed=rng.randint(0, 9000),
                  draining=rng.random() < 0.05, requests=None if rng.random() < 0.1 else states,
                  running_max=rng.choice([None, 10, 45]))
    reserved = [request_state(request(rng.randint(1, 300), rng.randint(1, 400), rng.random() < 0.3,
                                      rng.randint(0, 5))) for _ in range(rng.randint(0, 4))]
    return record, reserved, request(rng.randint(1, 300), rng.randint(1, 400), rng.random() < 0.3, rng.randint(0, 5))


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
        view = WorkerView(record, reserved[:2], r)
        for state in reserved[2:]:  # dispatched after the view was built
            view.add(state)
        expected = check_worker(record, reserved, req, r.policy, r.estimator, r.margin)
        assert view.ratio(Candidate(request_state(req), r)) == expected


def test_choose_view_picks_what_choose_worker_picks(same_draws):
    rng = random.Random(7)
    r = rule("past_future", rng)
    for _ in range(50):
        cases = [random_case(rng) for _ in range(6)]
        loads = {f"w{i}": c[0].model_copy(update={"worker_id": f"w{i}"}) for i, c in enumerate(cases)}
        reserved = {f"w{i}": c[1] for i, c in enumerate(cases)}
        req = cases[0][2]
        views = Views(r)
        views.refresh(loads, reserved)
        assert choose_view(views, Candidate(request_state(req), r)) == choose_worker(
            loads, reserved, req, r.policy, r.estimator, r.margin)


def test_a_group_counts_its_prompt_once():
    group = request(100, 10).model_copy(update={"n": 3})
    states = request_states(group)
    assert len(states) == 3 and sum(s.conservative_need for s in states) == 100 + 3 * 10
    r = AdmissionRule(AdmissionSettings(admission="conservative"))
    assert check_worker(load("w", max_total=130, requests=[]), [], group, r.policy, r.estimator, r.margin) == 1.0
    assert check_worker(load("w", max_total=129, requests=[]), [], group, r.policy, r.estimator, r.margin) is None
