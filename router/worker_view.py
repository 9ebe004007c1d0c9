"""One worker as the router's admission check sees it, prepared once per record.

``check_worker`` redoes, for every request and every worker, K Monte-Carlo
draws over all of that worker's requests and K peaks: O(W K n log n) per
decision, nearly all of the router's time at 32 workers. But a worker's
published requests change only with its record, and this router's
reservations only when it dispatches or learns another router's dispatch.
So a view draws the remaining lengths of those requests once and keeps each
draw as a ``SortedPeak``; a decision then costs O(K log n) per worker, and a
dispatch adds its request to one view in O(K n).

The answers are ``check_worker``'s: exactly for conservative, aggressive and
the quantile estimate; for past_future the same computation over draws made
once per view instead of once per call (both fixed per seed, so a blocked
head of line gets the same answer until something changes). Groups (n > 1)
are rare and go through ``check_worker`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.admission import AdmissionRule
from shared.peak import ReqState, SortedPeak, num_draws, use_limit
from shared.schemas import WorkerLoad

MAX_DRAWS = num_draws(0)  # K for an empty batch: the most a check ever takes


class Candidate:
    """A request about to be placed: its state and, per draw, its remaining length."""

    def __init__(self, state: ReqState, rule: AdmissionRule):
        self.state = state
        estimator = rule.estimator
        if rule.policy == "past_future_quantile":
            self.remaining = [estimator.remaining_quantile(state)]
        else:  # re-seeded: the same request gets the same draws on every retry
            estimator.rng.seed(estimator.seed)
            self.remaining = [estimator.remaining_sampled(state) for _ in range(MAX_DRAWS)]


class WorkerView:
    def __init__(self, load: WorkerLoad, reserved: Sequence[ReqState], rule: AdmissionRule):
        self.load = load
        self.policy = rule.policy
        self.estimator = rule.estimator
        self.summed = self.policy in ("conservative", "aggressive") or load.requests is None
        # No summaries published (an older worker): its committed tokens, checked conservatively.
        self.fallback = load.requests is None
        self.limit = load.max_total_tokens if self.fallback else use_limit(load.max_total_tokens, self.policy,
                                                                          rule.margin)
        states = [] if self.fallback else [ReqState(*r) for r in load.requests]
        self.count = len(states)
        self.reserved = 0  # states added after the record: this router's reservations
        self.total = load.committed_tokens if self.fallback else sum(self._term(s) for s in states)
        self.draws: list[SortedPeak] = []
        if not self.summed:
            self._draw(states)
        for state in reserved:
            self.add(state)

    def _term(self, state: ReqState) -> int:
        if self.fallback or self.policy == "conservative":
            return state.conservative_need
        return state.held

    def _draw(self, states: list[ReqState]) -> None:
        if self.policy == "past_future_quantile":
            self.draws = [SortedPeak((s.held, self.estimator.remaining_quantile(s)) for s in states)]
            return
        self.estimator.rng.seed(self.estimator.seed)
        self.draws = [SortedPeak((s.held, self.estimator.remaining_sampled(s)) for s in states)
                      for _ in range(num_draws(len(states)))]

    def add(self, state: ReqState) -> None:
        """A request now counts against this worker (dispatched, or seen in its inbox)."""
        self.count += 1
        self.reserved += 1
        self.total += self._term(state) if self.summed else 0
        for draw in self.draws:
            remaining = (self.estimator.remaining_quantile(state) if self.policy == "past_future_quantile"
                         else self.estimator.remaining_sampled(state))
            draw.add(state.held, remaining)

    def ratio(self, candidate: Candidate) -> float | None:
        """Use / pool with the candidate, or None if it does not fit (``check_worker``'s answer)."""
        load = self.load
        if load.draining:
            return None
        if (not self.fallback and load.running_max_req_size is not None
                and self.count + 1 > load.running_max_req_size):
            return None
        if self.summed:
            use = self.total + self._term(candidate.state)
        else:  # K follows the batch without the candidate, as in the paper
            held = candidate.state.held
            use = max(draw.peak_with(held, remaining)
                      for draw, remaining in zip(self.draws[:num_draws(self.count)], candidate.remaining))
        return use / load.max_total_tokens if use <= self.limit else None


class Views:
    """A view per admissible worker, kept in step with the router's reservations.

    Invariant: a view has counted exactly the reservations it was built with
    plus every state ``count`` added since; the router adds a decision's states
    before its dispatch is sent (so the next decision of the same run sees
    them), and ``refresh`` rebuilds the views of workers whose dispatches were
    not written (those tentative counts are undone) or whose record changed.
    """

    def __init__(self, rule: AdmissionRule):
        self.rule = rule
        self._views: dict[str, WorkerView] = {}

    def clear(self) -> None:
        """Every view goes (their draws came from an older history)."""
        self._views.clear()

    def refresh(self, loads: dict[str, WorkerLoad], pending: dict[str, list[ReqState]],
                rebuild: set[str] = frozenset()) -> None:
        views = {}
        for worker_id, load in loads.items():
            view, reserved = self._views.get(worker_id), pending.get(worker_id, ())
            same = (view is not None and worker_id not in rebuild and view.load.seq == load.seq
                    and view.load.ts_ms == load.ts_ms and view.reserved == len(reserved))
            views[worker_id] = view if same else WorkerView(load, reserved, self.rule)
        self._views = views

    def ratios(self, candidate: Candidate) -> dict[str, float | None]:
        return {worker_id: view.ratio(candidate) for worker_id, view in self._views.items()}

    def count(self, worker_id: str, states: Sequence[ReqState]) -> None:
        view = self._views.get(worker_id)
        if view is not None:
            for state in states:
                view.add(state)
