"""The peak formula against a step-by-step simulation; no torch, no Redis."""

import random
import subprocess
import sys

import pytest

from shared.peak import ReqState, SortedPeak, num_draws, peak_tokens, worst_peak


def simulated_peak(pairs):
    """Step the batch: request j holds a_j + t while t <= b_j, then nothing."""
    horizon = max((b for _, b in pairs), default=0)
    return max((sum(a + t for a, b in pairs if b >= t) for t in range(horizon + 1)), default=0)


def test_worked_example_from_the_module_doc():
    pairs = [(10, 50), (20, 30), (40, 5), (5, 0)]
    assert peak_tokens(pairs) == simulated_peak(pairs) == 90
    assert sum(a + b for a, b in pairs) == 160  # what the conservative sum would reserve


@pytest.mark.parametrize("seed", range(300))
def test_formula_equals_step_by_step_simulation(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 12)
    hi = rng.choice([3, 20, 200])  # small ranges force ties in b
    pairs = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(n)]
    assert peak_tokens(pairs) == simulated_peak(pairs)


@pytest.mark.parametrize("seed", range(100))
def test_sorted_peak_with_one_more_pair_equals_the_simulation(seed):
    """The router's O(log n) peak-with-a-candidate, and pairs added one by one."""
    rng = random.Random(seed)
    hi = rng.choice([3, 20, 200])
    pairs = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(rng.randint(0, 12))]
    sorted_peak = SortedPeak(pairs)
    for _ in range(6):
        candidate = (rng.randint(0, hi), rng.randint(0, hi))
        assert sorted_peak.peak_with(*candidate) == simulated_peak([*pairs, candidate])
        if rng.random() < 0.5:
            sorted_peak.add(*candidate)
            pairs.append(candidate)
        assert sorted_peak.peak() == simulated_peak(pairs) and len(sorted_peak) == len(pairs)


@pytest.mark.parametrize("seed", range(30))
def test_a_run_of_adds_then_a_question_equals_the_simulation(seed):
    """``add`` defers the rebuild to the next question: several adds must all be in it."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(rng.randint(0, 12))]
    sorted_peak = SortedPeak(pairs)
    for _ in range(rng.randint(1, 6)):
        pairs.append((rng.randint(0, 50), rng.randint(0, 50)))
        sorted_peak.add(*pairs[-1])
    candidate = (rng.randint(0, 50), rng.randint(0, 50))
    assert sorted_peak.peak_with(*candidate) == simulated_peak([*pairs, candidate])
    assert sorted_peak.peak() == simulated_peak(pairs)


@pytest.mark.parametrize("seed", range(50))
def test_sorted_peak_with_several_more_pairs_equals_the_simulation(seed):
    """A group's samples asked about at once (``peak_with_all``)."""
    rng = random.Random(seed)
    hi = rng.choice([3, 20, 200])
    pairs = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(rng.randint(0, 12))]
    sorted_peak = SortedPeak(pairs)
    sorted_peak.add(5, 5)  # unbuilt adds count too
    group = [(rng.randint(0, hi), rng.randint(0, hi)) for _ in range(rng.randint(1, 4))]
    assert sorted_peak.peak_with_all(group) == simulated_peak([*pairs, (5, 5), *group])


def test_order_of_the_input_does_not_matter():
    pairs = [(5, 1), (1, 9), (7, 7), (3, 9)]
    assert peak_tokens(pairs) == peak_tokens(list(reversed(pairs))) == simulated_peak(pairs)


def test_a_candidate_fits_within_the_margin():
    pairs = [(10, 50), (20, 30)]
    # with (40, 5): peak = max(60, 30+60, 70+15) = 90
    assert peak_tokens([*pairs, (40, 5)]) <= 100 * (1 - 0.1)
    assert not peak_tokens([*pairs, (40, 5)]) <= 100 * (1 - 0.11)
    assert peak_tokens([(10, 10)]) <= 20 * (1 - 0)


def test_num_draws_follows_the_paper():
    assert [num_draws(n) for n in (0, 1, 39, 40, 66, 67, 100, 199, 200, 1000)] == [5, 5, 5, 5, 4, 3, 3, 2, 2, 1]


def test_worst_peak_takes_the_largest_draw():
    states = [ReqState(10, 0, 100, 0), ReqState(10, 0, 100, 0)]
    draws = iter([1, 1, 50, 50, 2, 2])  # three draws of two requests
    assert worst_peak(states, lambda s: next(draws), 3) == 20 + 2 * 50


def test_conservative_need_is_prompt_plus_max_new_tokens():
    assert ReqState(held=30, generated=10, max_new_tokens=50, ignore_eos=0).conservative_need == 70


def test_bookkeeping_imports_no_torch():
    code = "import sys, shared.peak, shared.history; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
