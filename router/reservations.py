"""Tokens this router dispatched to a worker that its heartbeat does not show yet.

Published loads arrive late; admitting on them alone lets a burst land on
one worker (llm-d's thundering herd). Each dispatch is held against its
worker until a load record says the worker took in that inbox entry
(``last_inbox_id``), or until ``ttl_s`` passes (a worker that never reports
it is dead and its inbox gets re-dispatched anyway).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from shared.schemas import WorkerLoad, stream_id


@dataclass(frozen=True)
class Reservation:
    inbox_id: str
    tokens: int
    made_at: float


class Reservations:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._by_worker: dict[str, list[Reservation]] = defaultdict(list)

    def add(self, worker_id: str, inbox_id: str, tokens: int) -> None:
        self._by_worker[worker_id].append(Reservation(inbox_id, tokens, time.monotonic()))

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

    def tokens(self) -> dict[str, int]:
        return {w: sum(r.tokens for r in rs) for w, rs in self._by_worker.items()}
