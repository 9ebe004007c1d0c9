"""Output-length history: the prior washing out, and sampling L | L > d."""

import statistics

import pytest

from shared.history import Estimator, OutputLengthHistory
from shared.peak import ReqState


def test_prior_fills_the_window_like_the_papers_deque():
    h = OutputLengthHistory(window=10, prior=999)
    assert h.values == [999] * 5
    h.update([1, 2, 3])
    assert h.values == [1, 2, 3] + [999] * 5  # the first window/2 samples join the prior
    h.update(list(range(1, 8)))
    assert h.values == list(range(1, 8)) + [999] * 3  # then each pushes one prior out
    h.update([str(x) for x in range(1, 13)])  # Redis hands back strings, newest first
    assert h.values == list(range(1, 11))  # only the newest `window` count, no prior left


def test_empty_history_above_d_gives_uniform_up_to_the_cap():
    h = OutputLengthHistory(window=4, prior=10)  # [10, 10]
    # d = 20 is past every sample: the support is [20, 100], linear in u
    assert [h.total_at(20, 100, u) for u in (0.0, 0.5, 0.999)] == [20, 60, 100]
    assert h.total_at(5, 8, 0.999) == 8  # capped by max_new_tokens
    assert h.total_at(100, 100, 0.3) == 100  # already at the cap


def test_conditional_draws_follow_the_empirical_distribution():
    h = OutputLengthHistory(window=1000, prior=1)
    h.update(list(range(1, 1001)))  # lengths uniform on 1..1000
    est = Estimator(h, seed=1)
    d = 500
    totals = [d + est.remaining_sampled(ReqState(600, d, 1000, 0)) for _ in range(20000)]
    assert min(totals) > d and max(totals) <= 1000
    assert statistics.mean(totals) == pytest.approx(750, abs=5)  # L | L > 500 is uniform on 501..1000
    assert sorted(totals)[int(0.9 * len(totals))] == pytest.approx(950, abs=8)
    assert d + est.remaining_quantile(ReqState(600, d, 1000, 0)) == pytest.approx(950, abs=1)


def test_a_request_past_the_short_mode_is_expected_to_be_long():
    h = OutputLengthHistory(window=200, prior=1)
    h.update([10] * 100 + [1000] * 100)  # half the requests stop at 10, half run to 1000
    est = Estimator(h, quantile=0.5, seed=0)
    assert est.remaining_quantile(ReqState(100, 0, 1000, 0)) == 10  # a new request: the median is short
    fresh = [est.remaining_sampled(ReqState(100, 0, 1000, 0)) for _ in range(4000)]
    assert 0.4 < sum(r <= 10 for r in fresh) / len(fresh) < 0.6
    survivor = ReqState(150, 50, 1000, 0)  # generated 50 > 10: it is one of the long ones
    assert est.remaining_quantile(survivor) == 950
    # only the first of the 100 support segments, [50, 1000], gives anything below 950
    assert sum(est.remaining_sampled(survivor) == 950 for _ in range(2000)) > 0.97 * 2000


def test_ignore_eos_is_exact_and_finished_requests_add_nothing():
    est = Estimator(OutputLengthHistory(window=10, prior=5), seed=0)
    assert est.remaining_sampled(ReqState(30, 10, 500, 1)) == 490
    assert est.remaining_quantile(ReqState(30, 10, 500, 1)) == 490
    assert est.remaining_sampled(ReqState(30, 500, 500, 0)) == 0
    assert est.remaining_sampled(ReqState(30, 7, 500, 0)) >= 1  # past every sample, still unfinished


def test_seeded_estimators_draw_the_same():
    h = OutputLengthHistory(window=50, prior=100)
    h.update(list(range(5, 300, 7)))
    states = [ReqState(20 + i, i, 400, 0) for i in range(30)]
    a, b = Estimator(h, seed=7), Estimator(h, seed=7)
    assert [a.peak_sampled(states) for _ in range(5)] == [b.peak_sampled(states) for _ in range(5)]
    # asking again about the same batch is no new lottery ticket
    assert len({a.peak_sampled(states) for _ in range(20)}) == 1
    assert a.peak_sampled(states) != Estimator(h, seed=8).peak_sampled(states)


def test_monte_carlo_peak_is_at_least_the_typical_one_and_exact_when_lengths_are_known():
    h = OutputLengthHistory(window=100, prior=1)
    h.update(list(range(1, 101)))
    states = [ReqState(50, 0, 100, 0) for _ in range(8)]
    est = Estimator(h, quantile=0.5, seed=3)
    assert est.peak_sampled(states) >= est.peak_quantile(states) * 0.9
    exact = [ReqState(50, 0, 100, 1) for _ in range(8)]
    assert est.peak_sampled(exact) == est.peak_quantile(exact) == 8 * 150
