"""The peak KV-token use of a batch over all its future steps (LightLLM's formula).

Each request is a pair (a, b): a = tokens it holds now, b = tokens it will
still add. Assume every request adds one token per step and frees all of
its tokens the step it finishes. After t steps request j holds a_j + t while
t <= b_j and nothing after, so the use at time t is

    U(t) = sum over {j : b_j >= t} of (a_j + t).

Between two consecutive distinct b values the alive set is fixed and U(t)
grows with t, so the maximum sits at some t = b_i (or at t = 0, which the
t = b_n term covers: n * b_n >= 0). Sort by b descending; at t = b_i the
alive set is the first i requests (ties: the last of a tied run sees them
all, and the max over i picks it), each grown by b_i:

    peak = max over i of ( a_1 + ... + a_i + i * b_i )

Example: (a, b) = (10, 50), (20, 30), (40, 5), (5, 0), already sorted by b:

    i | a_i  b_i | a_1..a_i | i * b_i | use at t = b_i
    1 |  10   50 |     10   |    50   |   60   only the first is alive (10 + 50)
    2 |  20   30 |     30   |    60   |   90   10+30 and 20+30: the peak
    3 |  40    5 |     70   |    15   |   85
    4 |   5    0 |     75   |     0   |   75   t = 0: what the batch holds now

The peak (90) comes 30 steps ahead, when the third request has long left:
summing a + b (conservative) would say 160. tests/shared/test_peak.py checks
the formula against a step-by-step simulation of random batches.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import NamedTuple, Protocol


class ReqState(NamedTuple):
    """What a worker publishes per running or waiting request.

    ``held`` counts prompt + output so far: the tokens the request holds in
    the pool once prefilled (a waiting request holds them after its prefill,
    which comes before any future step, so the peak counts them already).
    """

    held: int
    generated: int
    max_new_tokens: int
    ignore_eos: int  # 0 or 1: exact remaining length when set

    @property
    def conservative_need(self) -> int:
        """prompt + max_new_tokens: the most it can ever hold."""
        return self.held - self.generated + self.max_new_tokens


def group_states(prompt_tokens: int, outputs: Sequence[int], max_new_tokens: int, ignore_eos: int) -> list[ReqState]:
    """The states of a group's samples (one per entry of ``outputs``, its tokens so far)
    that share one copy of the prompt: it is counted once, with the first sample, so
    the conservative need is prompt + n x max_new_tokens. (The peak then assumes the
    prompt leaves with the first sample, which holds only if it is not the first to
    end; a group's samples draw their remaining lengths independently, as do requests.)"""
    return [
        ReqState(out + (prompt_tokens if i == 0 else 0), out, max_new_tokens, ignore_eos)
        for i, out in enumerate(outputs)
    ]


def peak_tokens(pairs: Iterable[tuple[int, int]]) -> int:
    """max over future steps of the tokens the batch holds; see the module doc."""
    held = peak = 0
    for i, (a, b) in enumerate(sorted(pairs, key=lambda p: -p[1]), 1):
        held += a
        peak = max(peak, held + i * b)
    return peak


class SortedPeak:
    """A batch's pairs kept sorted, for the peak of the batch plus one more pair in O(log n).

    The router asks this of every worker for every request. With the pairs
    sorted by b descending and V_j = A_j + j * b_j (A_j: held by the first j),
    a new pair (a, b) goes after the p pairs with b_j >= b: those keep V_j; the
    new one is worth A_p + a + (p + 1) * b; every later pair moves one place
    down and gains a, so it is worth V_j + b_j + a. Hence

        peak with (a, b) = max(max V_1..V_p, A_p + a + (p + 1) * b, max (V_j + b_j) over j > p, + a)

    from a prefix maximum and a suffix maximum. ``add`` keeps a pair; the
    O(n) rebuild waits for the next question, so a run of adds costs one.
    """

    def __init__(self, pairs: Iterable[tuple[int, int]] = ()):
        ordered = sorted(pairs, key=lambda p: -p[1])
        self._neg_b = [-b for _, b in ordered]  # ascending, for bisect
        self._held = [a for a, _ in ordered]
        self._stale = False  # pairs were added since the maxima were built
        self._rebuild()

    def _rebuild(self) -> None:
        self._stale = False
        held_before = list(accumulate(self._held, initial=0))  # [j]: held by the first j pairs
        values = [held_before[j] - j * nb for j, nb in enumerate(self._neg_b, 1)]  # V_j
        self._held_before = held_before
        self._prefix_max = list(accumulate(values, max, initial=0))
        shifted = [v - nb for v, nb in zip(values, self._neg_b)]  # V_j + b_j
        self._suffix_max = list(accumulate(reversed(shifted), max))[::-1] + [-1]  # -1: no pair after

    def __len__(self) -> int:
        return len(self._held)

    def peak(self) -> int:
        if self._stale:
            self._rebuild()
        return self._prefix_max[-1]

    def peak_with(self, a: int, b: int) -> int:
        """``peak_tokens`` of the pairs plus (a, b)."""
        if self._stale:
            self._rebuild()
        p = bisect_right(self._neg_b, -b)
        after = self._suffix_max[p] + a if p < len(self._held) else 0
        return max(self._prefix_max[p], self._held_before[p] + a + (p + 1) * b, after)

    def peak_with_all(self, pairs: Sequence[tuple[int, int]]) -> int:
        """``peak_tokens`` of the pairs plus several more (a group): O(n log n), groups are rare."""
        if len(pairs) == 1:
            return self.peak_with(*pairs[0])
        return peak_tokens([*zip(self._held, (-nb for nb in self._neg_b)), *pairs])

    def add(self, a: int, b: int) -> None:
        p = bisect_right(self._neg_b, -b)
        self._neg_b.insert(p, -b)
        self._held.insert(p, a)
        self._stale = True


def num_draws(batch_size: int) -> int:
    """Monte-Carlo draws for a batch (the paper's K): many for small batches,
    where one unlucky draw matters most, one from 200 requests up."""
    return min(5, 200 // max(batch_size, 1) + 1)


def worst_peak(states: Sequence[ReqState], remaining: Callable[[ReqState], int], draws: int) -> int:
    """The largest peak over ``draws`` independent estimates of every remaining length."""
    return max(peak_tokens([(s.held, remaining(s)) for s in states]) for _ in range(max(draws, 1)))


class Projection(Protocol):
    """How a policy projects a batch's use, from scratch (``shared.batch_view.Policy`` adds the prepared way)."""

    def use(self, states: Sequence[ReqState]) -> int:
        """The tokens ``states`` are expected to need at most."""
        ...

    def limit(self, max_total_tokens: int) -> float:
        """The most that use may be on a pool of ``max_total_tokens``."""
        ...


def check(
    states: Sequence[ReqState],
    candidate: ReqState | Sequence[ReqState],
    max_total_tokens: int,
    max_requests: int | None,
    policy: Projection,
) -> float | None:
    """Admission of ``candidate`` beside ``states`` on one pool, from scratch: the resulting
    use / pool, or None if it does not fit. The reference: the router and the worker ask
    ``shared.batch_view.BatchView``, which gives these answers faster (tests/shared/test_batch_view.py,
    tests/router/test_worker_view.py); bench/sim/scheduler_sim.py runs this. A group is admitted
    whole: pass its samples' states (``group_states``) as ``candidate``."""
    candidates = [candidate] if isinstance(candidate, ReqState) else list(candidate)
    if max_requests is not None and len(states) + len(candidates) > max_requests:
        return None
    use = policy.use([*states, *candidates])
    if use > policy.limit(max_total_tokens):
        return None
    return use / max_total_tokens
