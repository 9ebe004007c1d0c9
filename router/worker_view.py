"""One worker as the router's admission check sees it, prepared once per record.

``check_worker`` redoes, for every request and every worker, K Monte-Carlo
draws over all of that worker's requests and K peaks: O(W K n log n) per
decision, nearly all of the router's time at 32 workers. But a worker's
published requests change only with its record, and this router's
reservations only when it dispatches or learns another router's dispatch.
So a view of each worker (a ``shared.batch_view.BatchView`` of its record
plus its reservations) is kept until one of those changes; a decision then
costs O(K log n) per worker, and a dispatch adds its request to one view in
O(K n). The answers are ``check_worker``'s (see ``shared.batch_view``).
Groups (n > 1) are rare and go through ``check_worker`` itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shared.admission import AdmissionRule
from shared.batch_view import BatchView, Candidate
from router.choice import least_loaded_fit
from shared.peak import ReqState
from shared.schemas import WorkerLoad

__all__ = ["Candidate", "Views", "WorkerView"]


class WorkerView(BatchView):
    """A worker's record plus this router's reservations on it (``reserved``: counted as added)."""

    def __init__(self, load: WorkerLoad, reserved: Sequence[ReqState], rule: AdmissionRule):
        states = None if load.requests is None else [ReqState(*r) for r in load.requests]
        super().__init__(states, load.max_total_tokens, load.running_max_req_size, rule, load.committed_tokens)
        self.load = load
        for state in reserved:
            self.add(state)

    def ratio(self, candidate: Candidate) -> float | None:
        return None if self.load.draining else super().ratio(candidate)

    def use_ratio(self) -> float:
        """Use now / pool (a draining worker sorts last: it takes nothing)."""
        return math.inf if self.load.draining else self.use() / self.max_total_tokens


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
                    and view.load.ts_ms == load.ts_ms and view.added == len(reserved))
            views[worker_id] = view if same else WorkerView(load, reserved, self.rule)
        self._views = views

    def choose(self, candidate: Candidate, model: str | None = None) -> str | None:
        """``router.admission.least_loaded_fit`` over the views of workers serving ``model``:
        ``choose_worker``'s choice."""
        uses = {worker_id: view.use_ratio() for worker_id, view in self._views.items() if view.load.serves(model)}
        return least_loaded_fit(uses, lambda worker_id: self._views[worker_id].ratio(candidate))

    def admit(self, worker_id: str, candidate: Candidate) -> None:
        """The candidate was sent there: the next decision sees it."""
        view = self._views.get(worker_id)
        if view is not None:
            view.admit(candidate)

    def count(self, worker_id: str, states: Sequence[ReqState]) -> None:
        view = self._views.get(worker_id)
        if view is not None:
            for state in states:
                view.add(state)
