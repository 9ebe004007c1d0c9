"""A batch's admission check, prepared once for many candidates (``shared.peak.check``, faster).

``check`` redoes K Monte-Carlo draws over all n requests of a batch, and K
peaks, for every candidate: O(K n log n) a call. Between two changes of the
batch the draws need not change, so a view draws the remaining lengths once
and keeps each draw as a ``SortedPeak``: a candidate then costs O(K log n),
and admitting it costs O(K n). The router keeps one per worker record
(``router.worker_view``); a worker builds one per admission pass over its
own waiting queue (``worker.engine.engine``), where a burst of 1,000 requests took
0.6 s through ``check``.

The answers are ``check``'s: exactly for conservative, aggressive and the
quantile estimate; for past_future the same computation over draws made once
per view instead of once per call (both seeded, so a blocked head of line
gets the same answer until something changes). A group (n > 1) is a set of
states: it goes through ``check`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.admission import AdmissionRule
from shared.peak import ReqState, SortedPeak, num_draws, use_limit

MAX_DRAWS = num_draws(0)  # K for an empty batch: the most a check ever takes


class Candidate:
    """A request about to be placed: its state and, per draw, its remaining length."""

    def __init__(self, state: ReqState, rule: AdmissionRule):
        self.state = state
        estimator = rule.estimator
        if rule.policy == "past_future_quantile":
            self.remaining = [estimator.remaining_quantile(state)]
        elif rule.policy == "past_future":  # re-seeded: the same request gets the same draws on every retry
            estimator.rng.seed(estimator.seed)
            self.remaining = [estimator.remaining_sampled(state) for _ in range(MAX_DRAWS)]
        else:  # conservative, aggressive: sums, no lengths to estimate
            self.remaining = []


class BatchView:
    """The requests on one pool, ready to answer ``ratio(candidate)``.

    ``states`` None: the batch is known only by its ``committed`` tokens (a worker record
    without request summaries), checked conservatively against the whole pool.
    """

    def __init__(self, states: Sequence[ReqState] | None, max_total_tokens: int, max_requests: int | None,
                 rule: AdmissionRule, committed: int = 0):
        self.policy = rule.policy
        self.estimator = rule.estimator
        self.max_total_tokens = max_total_tokens
        self.max_requests = None if states is None else max_requests
        self.fallback = states is None
        self.summed = self.fallback or self.policy in ("conservative", "aggressive")
        self.limit = max_total_tokens if self.fallback else use_limit(max_total_tokens, self.policy, rule.margin)
        states = [] if states is None else list(states)
        self.count = len(states)
        self.added = 0  # states added since the view was built
        self.total = committed if self.fallback else sum(self._term(s) for s in states)
        self.draws: list[SortedPeak] = []
        if not self.summed:
            self._draw(states)
        self._use: int | None = None  # use() until the next add
        self._asked: tuple[Candidate, list[int]] | None = None  # the last candidate's peak per draw

    def _term(self, state: ReqState) -> int:
        if self.fallback or self.policy == "conservative":
            return state.conservative_need
        return state.held

    def _remaining(self, state: ReqState) -> int:
        if self.policy == "past_future_quantile":
            return self.estimator.remaining_quantile(state)
        return self.estimator.remaining_sampled(state)

    def _draw(self, states: list[ReqState]) -> None:
        if self.policy != "past_future_quantile":
            self.estimator.rng.seed(self.estimator.seed)
        draws = 1 if self.policy == "past_future_quantile" else num_draws(len(states))
        self.draws = [SortedPeak((s.held, self._remaining(s)) for s in states) for _ in range(draws)]

    def use(self) -> int:
        """The projected use without a candidate: what orders workers, least loaded first."""
        if self._use is None:
            self._use = self.total if self.summed else max((draw.peak() for draw in self.draws), default=0)
        return self._use

    def add(self, state: ReqState, remaining: Sequence[int] = ()) -> None:
        """A request now counts against this pool (admitted, dispatched, or seen in an inbox);
        ``remaining``: its length per draw, if already drawn (else drawn here)."""
        self.count += 1
        self.added += 1
        self._use, self._asked = None, None
        self.total += self._term(state) if self.summed else 0
        if self.policy != "past_future_quantile":
            del self.draws[num_draws(self.count):]  # K only shrinks as the batch grows: ratio reads them all
        for i, draw in enumerate(self.draws):
            draw.add(state.held, remaining[i] if remaining else self._remaining(state))

    def admit(self, candidate: Candidate) -> None:
        """``add`` the candidate, with its own draws; if ``ratio`` was just asked about it, its
        peaks are the view's use from now on, with no rebuild of the draws."""
        asked = self._asked[1] if self._asked is not None and self._asked[0] is candidate else None
        self.add(candidate.state, candidate.remaining)
        if asked is not None and not self.summed:
            self._use = max(asked[:len(self.draws)])

    def ratio(self, candidate: Candidate) -> float | None:
        """Use / pool with the candidate, or None if it does not fit (``check``'s answer)."""
        if self.max_requests is not None and self.count + 1 > self.max_requests:
            return None
        if self.summed:
            use = self.total + self._term(candidate.state)
        else:  # K follows the batch without the candidate, as in the paper (add keeps K draws)
            held = candidate.state.held
            peaks = [draw.peak_with(held, remaining) for draw, remaining in zip(self.draws, candidate.remaining)]
            self._asked = (candidate, peaks)
            use = max(peaks)
        return use / self.max_total_tokens if use <= self.limit else None
