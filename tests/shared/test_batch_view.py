"""BatchView, as the worker's admission pass uses it: a queue admitted in order through one
view (add after each admission) must stop exactly where ``check`` over the growing batch stops,
for the policies whose answer has no Monte-Carlo draws (past_future's draws are compared,
over fixed draws, in tests/router/test_worker_view.py)."""

import random
from typing import get_args

import pytest

from shared.admission import POLICIES, AdmissionRule
from shared.batch_view import BatchView, Candidate, SumTally
from shared.config import AdmissionSettings, PolicyName
from shared.peak import ReqState, check, group_states

EXACT = ["conservative", "aggressive", "past_future_quantile"]


def random_state(rng: random.Random) -> ReqState:
    prompt, max_new = rng.randint(1, 300), rng.randint(1, 400)
    done = rng.randint(0, max_new)
    return ReqState(prompt + done, done, max_new, int(rng.random() < 0.3))


def random_group(rng: random.Random) -> list[ReqState]:
    max_new = rng.randint(1, 400)
    return group_states(
        rng.randint(1, 300),
        [rng.randint(0, max_new) for _ in range(rng.randint(2, 4))],
        max_new,
        int(rng.random() < 0.3),
    )


def pass_by_check(running, queue, pool, cap, rule) -> list[float | None]:
    """Each queued request's answer, in order, until the first that does not fit (None)."""
    states, answers = list(running), []
    for state in queue:
        answers.append(check(states, state, pool, cap, rule.policy))
        if answers[-1] is None:
            break
        states += [state] if isinstance(state, ReqState) else state
    return answers


def pass_by_view(running, queue, pool, cap, rule) -> list[float | None]:
    view, answers = BatchView(running, pool, cap, rule.policy), []
    for state in queue:
        candidate = Candidate([state] if isinstance(state, ReqState) else state, rule.policy)
        answers.append(view.ratio(candidate))
        if answers[-1] is None:
            break
        view.admit(candidate)
    return answers


def test_every_policy_name_has_its_class():
    assert set(POLICIES) == set(get_args(PolicyName))
    assert all(AdmissionRule(AdmissionSettings(admission=name)).policy.name == name for name in POLICIES)


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


@pytest.mark.parametrize("policy", EXACT)
@pytest.mark.parametrize("seed", range(20))
def test_a_pass_over_a_queue_with_groups_stops_where_check_stops(policy, seed):
    """A group is one candidate of several states, its prompt counted once."""
    rng = random.Random(seed)
    rule = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    rule.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    running = [random_state(rng) for _ in range(rng.randint(0, 30))]
    queue = [random_group(rng) if rng.random() < 0.3 else random_state(rng) for _ in range(rng.randint(1, 40))]
    pool, cap = rng.choice([3000, 10000, 30000]), rng.choice([None, 20, 50])
    assert pass_by_view(running, queue, pool, cap, rule) == pass_by_check(running, queue, pool, cap, rule)


def test_the_view_keeps_only_the_draws_its_batch_size_reads():
    rule = AdmissionRule(AdmissionSettings(admission="past_future"))
    view = BatchView([], 10**6, None, rule.policy)
    assert len(view.tally.draws) == 5  # an empty batch takes K = 5 draws
    for _ in range(250):
        view.add([ReqState(100, 0, 50, 0)])
    assert len(view.tally.draws) == 1  # K = 1 from 200 requests up
    assert view.ratio(Candidate([ReqState(100, 0, 50, 0)], rule.policy)) is not None


@pytest.mark.parametrize("policy", ["past_future", *EXACT])
@pytest.mark.parametrize("seed", range(10))
def test_admitting_the_candidate_asked_about_makes_its_use_the_views(policy, seed):
    """``admit`` takes the use from the peaks ``ratio`` found, without rebuilding: it must be what
    the rebuilt draws (or the sums) give."""
    rng = random.Random(seed)
    rule = AdmissionRule(AdmissionSettings(admission=policy, history_window=50))
    rule.learn([rng.randint(1, 400) for _ in range(rng.randint(0, 60))])
    fresh_request = lambda: ReqState(rng.randint(1, 300), 0, rng.randint(100, 400), 0)  # noqa: E731 - unknown lengths
    view = BatchView([fresh_request() for _ in range(rng.randint(0, 30))], 10**6, None, rule.policy)
    for _ in range(8):
        candidate = Candidate([fresh_request()], rule.policy)
        expected = view.ratio(candidate)
        view.admit(candidate)
        assert view.use() == pytest.approx(expected * 10**6)
        fresh = view.tally.total if isinstance(view.tally, SumTally) else max(draw.peak() for draw in view.tally.draws)
        assert view.use() == fresh
