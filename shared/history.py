"""The "past" of past-future admission: recent output lengths and what they predict.

Workers LPUSH each finished request's output length onto a capped Redis
list; readers copy its newest ``window`` entries into an
``OutputLengthHistory`` now and then (the router about once a second, never
per request). Until enough requests have finished, the window is topped up
with a pessimistic prior, exactly as the paper's deque would be: it starts
with window/2 prior copies, the first window/2 samples join them, and each
sample after that pushes one prior out, so after ``window`` samples the
prior is gone.

Remaining-length estimate of a request that has generated d tokens (the
empirical inverse CDF of L given L > d, the Past-Future paper's sampler):
the support is d, then every history value above d in ascending order,
then the request's own ``max_new_tokens`` M if it is larger still (so the
tail reaches the cap and an empty history gives U[d, M]). A draw u in
[0, 1) picks the point u * (points - 1) on that support and interpolates
linearly between its neighbours; the quantile variant uses u = q. The
total is capped by M. With ``ignore_eos`` the total is M exactly.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import islice

from shared.peak import ReqState, num_draws, peak_tokens, worst_peak


class OutputLengthHistory:
    def __init__(self, window: int, prior: int):
        if window < 2 or prior < 1:
            raise ValueError("window must be >= 2 and prior >= 1")
        self.window = window
        self.prior = prior
        self._sorted: list[int] = []
        self.update([])

    def update(self, newest_first: Iterable[int | str]) -> None:
        """Replace the window with the newest lengths (Redis LRANGE order), plus what prior is left."""
        recent = [int(x) for x in islice(newest_first, self.window)]
        num_prior = max(0, min(self.window // 2, self.window - len(recent)))
        self._sorted = sorted(recent + [self.prior] * num_prior)

    @property
    def values(self) -> list[int]:
        return list(self._sorted)

    def total_at(self, generated: int, max_new_tokens: int, u: float) -> int:
        """Total output length at inverse-CDF position ``u`` of L | L > generated, capped.

        Support points, ascending: p_0 = d, then the history values above d,
        then the cap if it is above them all; ``u`` in [0, 1] maps to
        u * (points - 1). Hot in the simulator, so no helper calls.
        """
        d, cap, hist = generated, max_new_tokens, self._sorted
        if d >= cap:
            return cap
        first = bisect_right(hist, d)  # hist[first:] are the values above d
        num_hist = len(hist) - first
        segments = num_hist + (cap > (hist[-1] if num_hist else d))  # points - 1, >= 1 as d < cap
        pos = u * segments
        i = min(int(pos), segments - 1)  # segment [p_i, p_i+1]
        lo = d if i == 0 else hist[first + i - 1]
        hi = hist[first + i] if i < num_hist else cap
        return min(cap, math.ceil(lo + (hi - lo) * (pos - i)))


class Estimator:
    """Remaining lengths and batch peaks from one history, with a seeded RNG.

    ``peak_sampled`` is the paper's Monte-Carlo version (K draws, worst
    peak); ``peak_quantile`` the deterministic one (every unknown length at
    quantile q of its conditional distribution). Each ``peak_sampled`` call
    restarts the stream from ``seed``; ``seed=None`` draws afresh every call.
    """

    def __init__(self, history: OutputLengthHistory, quantile: float = 0.9, seed: int | None = 0):
        if not 0 < quantile <= 1:
            raise ValueError("quantile must be in (0, 1]")
        self.history = history
        self.quantile = quantile
        self.seed = seed
        self.rng = random.Random(seed)

    def _remaining(self, s: ReqState, u: float) -> int:
        if s.generated >= s.max_new_tokens:
            return 0
        if s.ignore_eos:
            return s.max_new_tokens - s.generated
        # An unfinished request adds at least one more token.
        return max(1, self.history.total_at(s.generated, s.max_new_tokens, u) - s.generated)

    def restart(self) -> None:
        """Back to the start of the seeded stream: the same questions get the same draws."""
        self.rng.seed(self.seed)

    def remaining_sampled(self, s: ReqState) -> int:
        return self._remaining(s, self.rng.random())

    def remaining_quantile(self, s: ReqState) -> int:
        return self._remaining(s, self.quantile)

    def peak_sampled(self, states: Sequence[ReqState]) -> int:
        # Every check restarts the seeded stream: asking again about the same batch (a blocked
        # head of line is retried every poll) gives the same answer instead of a fresh lottery
        # ticket, while the K draws within a check stay independent.
        self.restart()
        exact = all(s.ignore_eos or s.generated >= s.max_new_tokens for s in states)
        # K follows the batch without the candidate, as in the paper.
        draws = 1 if exact else num_draws(len(states) - 1)
        return worst_peak(states, self.remaining_sampled, draws)

    def peak_quantile(self, states: Sequence[ReqState]) -> int:
        return peak_tokens([(s.held, self.remaining_quantile(s)) for s in states])
