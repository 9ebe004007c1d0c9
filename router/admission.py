"""Which worker may take a request, and which of those gets it: the router's side of admission.

A worker's requests (its published record, plus the ones any router
dispatched there that the record does not show yet, ``router.reservations``,
plus the candidate) must fit its pool by the admission policy
(``shared.admission``). Each admissible worker is a ``WorkerView``: a
``shared.batch_view.BatchView`` of its record and this router's reservations,
kept until either changes. A worker's published requests change only with
its record, and the reservations only when this router dispatches or learns
another router's dispatch, so a decision costs O(K log n) per worker asked
(not K full peaks) and a dispatch adds its request to one view.

Which of the workers that pass gets the request: workers are visited in
order of their projected use now (use / pool), least loaded first, and of
the first ``CHOICES`` the request fits, the one with the lowest resulting
ratio wins (a small pool that a big request would fill loses to a larger
one). So a decision runs about ``CHOICES`` checks, not one per worker: at 32
workers, checking every one was three quarters of the router's time
(bench/RESULTS.md, the scale test). When the least loaded do not fit, the
walk goes on, so a request waits only if no worker can take it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from shared.batch_view import BatchView, Candidate, Policy
from shared.peak import ReqState
from shared.schemas import WorkerLoad

CHOICES = 2


def least_loaded_fit(
    uses: Mapping[str, float], ratio: Callable[[str], float | None], choices: int = CHOICES
) -> str | None:
    """``uses``: worker -> use ratio now; ``ratio(worker)``: the ratio with the request, None if it
    does not fit. Ties go to the less loaded, then to the lesser id."""
    fitting: list[tuple[float, int, str]] = []
    for _, worker_id in sorted((use, worker_id) for worker_id, use in uses.items()):
        result = ratio(worker_id)
        if result is not None:
            fitting.append((result, len(fitting), worker_id))
            if len(fitting) == choices:
                break
    return min(fitting)[2] if fitting else None


class WorkerView(BatchView):
    """A worker's record plus this router's reservations on it (``reserved``: counted as added).
    A draining worker takes nothing."""

    def __init__(self, load: WorkerLoad, reserved: Sequence[ReqState], policy: Policy):
        states = [ReqState(*r) for r in load.requests]
        super().__init__(states, load.max_total_tokens, load.running_max_req_size, policy)
        self.load = load
        self.add(reserved)

    def ratio(self, candidate: Candidate) -> float | None:
        return None if self.load.draining else super().ratio(candidate)

    def use_ratio(self) -> float:
        """Use now / pool (a draining worker sorts last)."""
        return math.inf if self.load.draining else self.use() / self.max_total_tokens


class Views:
    """A view per admissible worker, kept in step with the router's reservations.

    Invariant: a view has counted exactly the reservations it was built with
    plus every candidate ``admit`` added since; the router admits a decision's
    candidate before its dispatch is sent (so the next decision of the same run
    sees it), and ``refresh`` rebuilds the views of workers whose dispatches
    were not written (those tentative counts are undone) or whose record changed.
    """

    def __init__(self, policy: Policy):
        self.policy = policy
        self._views: dict[str, WorkerView] = {}

    def clear(self) -> None:
        """Every view goes (their draws came from an older history)."""
        self._views.clear()

    def refresh(
        self,
        loads: Mapping[str, WorkerLoad],
        pending: Mapping[str, Sequence[ReqState]],
        rebuild: set[str] | frozenset[str] = frozenset(),
    ) -> None:
        views = {}
        for worker_id, load in loads.items():
            view, reserved = self._views.get(worker_id), pending.get(worker_id, ())
            same = (
                view is not None
                and worker_id not in rebuild
                and view.load.seq == load.seq
                and view.load.ts_ms == load.ts_ms
                and view.added == len(reserved)
            )
            views[worker_id] = view if same else WorkerView(load, reserved, self.policy)
        self._views = views

    def choose(self, candidate: Candidate, model: str | None = None) -> str | None:
        """The least loaded worker serving ``model`` that the candidate fits (``least_loaded_fit``),
        or None: the request waits."""
        uses = {worker_id: view.use_ratio() for worker_id, view in self._views.items() if view.load.serves(model)}
        return least_loaded_fit(uses, lambda worker_id: self._views[worker_id].ratio(candidate))

    def admit(self, worker_id: str, candidate: Candidate) -> None:
        """The candidate was sent there: the next decision sees it."""
        view = self._views.get(worker_id)
        if view is not None:
            view.admit(candidate)
