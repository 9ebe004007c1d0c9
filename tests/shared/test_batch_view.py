"""BatchView, as the worker's admission pass uses it: a queue admitted in order through one
view (add after each admission) must stop exactly where ``check`` over the growing batch stops,
for the policies whose answer has no Monte-Carlo draws (past_future's draws are compared,
over fixed draws, in tests/router/test_worker_view.py)."""

import random

import pytest

from shared.admission import AdmissionRule
from shared.batch_view import BatchView, Candidate
from shared.config import AdmissionSettings
from shared.peak import ReqState, check

EXACT = ["conservative", "aggressive", "past_future_quantile"]


def random_state(rng: random.Random) -> ReqState:
    prompt, max_new = rng.randint(1, 300), rng.randint(1, 400)
    done = rng.randint(0, max_new)
    return ReqState(prompt + done, done, max_new, int(rng.random() < 0.3))


def pass_by_check(running, queue, pool, cap, rule) -> list[float | None]:
    """Each queued request's answer, in order, until the first that does not fit (None)."""
    states, answers = list(running), []
    for state in queue:
        answers.append(check(states, state, pool, cap, rule.policy, rule.estimator, rule.margin))
        if answers[-1] is None:
            break
        states.append(state)
    return answers


def pass_by_view(running, queue, pool, cap, rule) -> list[float | None]:
    view, answers = BatchView(running, pool, cap, rule), []
    for state in queue:
        answers.append(view.ratio(Candidate(state, rule)))
        if answers[-1] is None:
            break
        view.add(state)
    return answers


@pytest.mark.parametrize("policy", EXACT)
@pytest.mark.parametrize("seed", range(30))
def test_a_pass_over_a_queue_stops_where_check_stops(policy, seed):
    rng = random.Random(seed)
    rule = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    rule.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    running = [random_state(rng) for _ in range(rng.randint(0, 30))]
    queue = [random_state(rng) for _ in range(rng.randint(1, 60))]
    pool, cap = rng.choice([3000, 10000, 30000]), rng.choice([None, 20, 50])
    assert pass_by_view(running, queue, pool, cap, rule) == pass_by_check(running, queue, pool, cap, rule)


def test_the_view_keeps_only_the_draws_its_batch_size_reads():
    rule = AdmissionRule(AdmissionSettings(admission="past_future"))
    view = BatchView([], 10**6, None, rule)
    assert len(view.draws) == 5  # an empty batch takes K = 5 draws
    for _ in range(250):
        view.add(ReqState(100, 0, 50, 0))
    assert len(view.draws) == 1  # K = 1 from 200 requests up
    assert view.ratio(Candidate(ReqState(100, 0, 50, 0), rule)) is not None


@pytest.mark.parametrize("policy", ["past_future", *EXACT])
@pytest.mark.parametrize("seed", range(10))
def test_admitting_the_candidate_asked_about_makes_its_use_the_views(policy, seed):
    """``admit`` takes the use from the peaks ``ratio`` found, without rebuilding: it must be what
    the rebuilt draws (or the sums) give."""
    rng = random.Random(seed)
    rule = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    rule.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    fresh_request = lambda: ReqState(rng.randint(1, 300), 0, rng.randint(100, 400), 0)  # noqa: E731 - unknown lengths
    view = BatchView([fresh_request() for _ in range(rng.randint(0, 30))], 10**6, None, rule)
    for _ in range(8):
        candidate = Candidate(fresh_request(), rule)
        expected = view.ratio(candidate)
        view.admit(candidate)
        assert view.use() == pytest.approx(expected * 10**6)
        fresh = view.total if view.summed else max(draw.peak() for draw in view.draws)
        assert view.use() == fresh
