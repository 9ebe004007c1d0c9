"""Requests dispatched to a worker that its heartbeat does not show yet, from every router.

Published loads arrive late; admitting on them alone lets a burst land on
one worker (llm-d's thundering herd). The worker's inbox stream is the
ledger of dispatches: the entries after the ``last_inbox_id`` of its load
record are exactly the requests the record does not show, whichever router
sent them. This class is this router's copy of that tail, per live worker,
as the same ``ReqState`` summary the worker will publish for each request.

The copy is kept up to date without reading the inbox on every decision:
``router.dispatch`` appends to an inbox only if the inbox holds nothing
after the ``tail`` this copy knows of, and otherwise hands back the newer
entries, which ``learn`` adds before the router decides again. So a
decision is checked against every dispatch to that worker, by any router,
at the instant it is written: two routers cannot over-admit a worker
together.

An entry leaves the copy when a load record's ``last_inbox_id`` passes it
(from then on the record lists the request itself), and a worker's whole
copy goes when the worker leaves the live set (the janitor re-dispatches
its inbox). There is no timeout: an entry the worker never takes in is
still in its inbox and still holds its room.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from shared.admission import request_states
from shared.peak import ReqState
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad, stream_id, tally_preemptible


class Pausable(NamedTuple):
    """A dispatched request a better class could pause once its worker holds it."""

    priority: int
    held: int  # the tokens it holds there (prompt and emitted; a group's prompt once)
    preemptions: int  # times paused already (the worker pauses one at most --max_preemptions times)
    slots: int = 1  # request slots its pause frees: a group's open samples


def pausable(request: GenerateRequest) -> Pausable | None:
    """``request`` as a worker's preemption would see it (a group whole, as
    ``worker.engine.load.preemptible_classes`` lists it): None for a request sending prompt
    log-probabilities, which this router does not count on pausing."""
    if request.params.prompt_logprobs is not None:
        return None
    states = request_states(request)
    return Pausable(request.priority, sum(s.held for s in states), request.preemptions, len(states))


class Reservations:
    def __init__(self) -> None:
        self._by_worker: dict[str, dict[str, tuple[ReqState, ...]]] = {}  # inbox id -> states, in id order
        self._tail: dict[str, str] = {}  # newest inbox id known of: everything up to it is accounted for
        self._pausable: dict[str, dict[str, Pausable]] = {}  # worker -> inbox id -> the entry's, if any

    def tail(self, worker_id: str) -> str:
        return self._tail.get(worker_id, "0-0")

    def add(self, worker_id: str, inbox_id: str, request: GenerateRequest) -> None:
        """An entry appended after ``tail(worker_id)`` (ours or another router's): a request's
        state, or a group's samples'."""
        self._by_worker.setdefault(worker_id, {})[inbox_id] = request_states(request)
        if (paused := pausable(request)) is not None:
            self._pausable.setdefault(worker_id, {})[inbox_id] = paused
        self._tail[worker_id] = inbox_id

    def learn(self, worker_id: str, entries: list[tuple[str, GenerateRequest]]) -> None:
        """Entries found after our tail, oldest first."""
        for inbox_id, request in entries:
            self.add(worker_id, inbox_id, request)

    def settle(self, loads: Mapping[str, WorkerLoad]) -> None:
        """Drop entries the workers' records now include, and workers that left."""
        for worker_id in list(self._tail):
            if worker_id not in loads:
                del self._tail[worker_id]
                self._by_worker.pop(worker_id, None)
                self._pausable.pop(worker_id, None)
        for worker_id, load in loads.items():
            seen = stream_id(load.last_inbox_id)
            if stream_id(self.tail(worker_id)) < seen:  # the record covers everything up to its id
                self._tail[worker_id] = load.last_inbox_id
            states = self._by_worker.get(worker_id)
            if states:
                kept = {i: s for i, s in states.items() if stream_id(i) > seen}
                if kept:
                    self._by_worker[worker_id] = kept
                else:
                    del self._by_worker[worker_id]
            paused = self._pausable.get(worker_id)
            if paused:
                self._pausable[worker_id] = {i: p for i, p in paused.items() if stream_id(i) > seen}

    def preemptible(self, loads: Mapping[str, WorkerLoad]) -> dict[str, list[tuple[int, int, int]]]:
        """worker -> [priority, tokens, requests] a better class may pause there: its record's
        ``preemptible`` plus what was sent there since (the record lags admission by up to a
        heartbeat, and a request just sent is running, or waits, by the time an ask is read)."""
        out = {}
        for worker_id, load in loads.items():
            sent = self._pausable.get(worker_id, {}).values()
            pausable = [(p.priority, p.held, p.slots) for p in sent if p.preemptions < load.max_preemptions]
            out[worker_id] = tally_preemptible([*load.preemptible, *pausable])
        return out

    def pending(self) -> dict[str, list[ReqState]]:
        """worker -> summaries of the requests dispatched there and not yet in its record."""
        return {w: [s for entry in entries.values() for s in entry] for w, entries in self._by_worker.items()}

    def tokens(self) -> dict[str, int]:
        """worker -> conservative need (prompt + max_new_tokens) of those requests."""
        return {w: sum(s.conservative_need for s in ss) for w, ss in self.pending().items()}
