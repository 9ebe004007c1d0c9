"""Requests this router dispatched to a worker that its heartbeat does not show yet.

Published loads arrive late; admitting on them alone lets a burst land on
one worker (llm-d's thundering herd). Each dispatch is held against its
worker, as the same ``ReqState`` summary the worker will publish for it,
until a load record says the worker took in that inbox entry
(``last_inbox_id``: from then on the record lists the request itself), or
until ``ttl_s`` passes (a worker that never reports it is dead and its
inbox gets re-dispatched anyway).

These reservations live in this router's memory: two routers sharing a
worker each see only their own, and can over-admit it together between
two of its heartbeats. The worker's own check is what keeps its pool safe.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from shared.peak import ReqState
from shared.schemas import WorkerLoad, stream_id


@dataclass(frozen=True)
class Reservation:
    inbox_id: str
    state: ReqState
    made_at: float


class Reservations:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._by_worker: dict[str, list[Reservation]] = defaultdict(list)

    def add(self, worker_id: str, inbox_id: str, state: ReqState) -> None:
        self._by_worker[worker_id].append(Reservation(inbox_id, state, time.monotonic()))

    def settle(self, loads: Mapping[str, WorkerLoad]) -> None:
        """Drop reservations the workers' records now include, and stale ones."""
        now = time.monotonic()
        for worker_id in list(self._by_worker):
            load = loads.get(worker_id)
            seen = stream_id(load.last_inbox_id) if load else (0, 0)
            kept = [r for r in self._by_worker[worker_id]
                    if stream_id(r.inbox_id) > seen and now - r.made_at < self.ttl_s]
            if kept and load is not None:
                self._by_worker[worker_id] = kept
            else:
                del self._by_worker[worker_id]

    def pending(self) -> dict[str, list[ReqState]]:
        """worker -> summaries of the requests dispatched there and not yet in its record."""
        return {w: [r.state for r in rs] for w, rs in self._by_worker.items()}

    def tokens(self) -> dict[str, int]:
        """worker -> conservative need (prompt + max_new_tokens) of those requests."""
        return {w: sum(r.state.conservative_need for r in rs) for w, rs in self._by_worker.items()}
