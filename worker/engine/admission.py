"""The worker's own admission: which waiting requests start, and what a step prefills.

The check is the router's (``shared.admission``, ``shared.batch_view``), on the
worker's pool: conservative (prompt + max_new_tokens of everything running
fits, so the pool can never run out) or past-future (the estimated peak
fits). Waiting requests start in queue order (priority class, then arrival:
``Engine.add``) until one does not fit; a request the runner cannot start yet
(its grammar compiles, off the loop) or whose prompt starts like a prefill
still in progress keeps its place and is passed over. With the prefix cache,
a request counts only what it adds to the pool: not the part of its prefix
that running requests already hold (``adds``).

Invariant: ``admit`` runs on the model loop's thread, under the engine's lock
(the heartbeat thread reads the queue and the running set).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from shared.admission import AdmissionRule
from shared.batch_view import BatchView, Candidate
from shared.peak import ReqState
from worker.engine.kv_slots import KVSlots
from worker.engine.load import request_states
from worker.engine.request import Phase, Req


@dataclass(frozen=True)
class EngineLimits:
    max_total_tokens: int
    batch_max_tokens: int  # prompt tokens prefilled in one step, over all chunks
    running_max_req_size: int


class Starter(Protocol):
    """What admission asks of the runner: its slots, and whether and how a request starts."""

    slots: KVSlots

    def prepare(self, req: Req) -> bool: ...
    def start(self, req: Req) -> None: ...


class Admission:
    def __init__(self, runner: Starter, limits: EngineLimits, rule: AdmissionRule):
        self.runner = runner
        self.limits = limits
        self.rule = rule  # the router's rule, from the same settings (shared.admission)

    def admit(self, waiting: deque[Req], running: list[Req]) -> list[Req]:
        """Move waiting requests into ``running``, in order, while the rule allows. One whose prompt
        starts like a prefill still in progress stays waiting, in its place, until that prefill joins
        the prefix cache (``KVSlots.should_wait``): usually one step. So does one the runner cannot
        start yet (``Starter.prepare``: its grammar compiles), for as long as that takes; the
        requests behind it go ahead meanwhile."""
        admitted: list[Req] = []
        policy = self.rule.policy
        view: BatchView | None = None  # built for the first request that may start (none: no cost)
        slots = self.runner.slots
        prefilling = {k for r in running if not r.is_prefilled and (k := slots.prefill_key(r)) is not None}
        deferred: list[Req] = []  # held by the runner, or waiting for a running prefill of their prefix
        # A suspect (a worker died with it running: GenerateRequest.attempt) prefills alone: started
        # only when no prefill is under way, and nothing starts beside it until its prefill is done,
        # so if it kills this worker too, the death is counted against it and nobody else.
        isolated = any(r.is_suspect and not r.is_prefilled for r in running)
        while waiting and not isolated:
            req = waiting[0]
            if req.is_suspect and (admitted or any(not r.is_prefilled for r in running)):
                break
            key = slots.prefill_key(req)
            if not self.runner.prepare(req) or slots.should_wait(req, key, prefilling):
                deferred.append(waiting.popleft())
                continue
            if view is None:
                # Prepared once for the pass: each candidate costs O(K log n), not O(K n log n)
                # from scratch (a burst of 1,000 requests took 0.6 s of one step that way).
                limits = self.limits
                view = BatchView(request_states(running), limits.max_total_tokens, limits.running_max_req_size, policy)
            candidate = Candidate(self.adds(req), policy)  # a group: all its samples, the prompt once
            if view.ratio(candidate) is None:
                break
            waiting.popleft()
            self.runner.start(req)
            slots.attach_prefix(req)
            req.phase = Phase.RUNNING
            running.append(req)
            admitted.append(req)
            view.admit(candidate)
            if key is not None:
                prefilling.add(key)
            isolated = req.is_suspect
        waiting.extendleft(reversed(deferred))  # in their places, ahead of the one that did not fit
        return admitted

    def adds(self, req: Req) -> list[ReqState]:
        """What ``req`` would add to the pool: its states, less the cached prefix running requests
        hold already (their states count it; ``worker.engine.load``). The rest of a hit is
        unreferenced: free now, but the request would hold it, so it counts."""
        states = request_states([req])
        held = self.runner.slots.held_prefix(req)
        if held:
            states[0] = states[0]._replace(held=states[0].held - held)
        return states

    def prefill_chunks(self, running: list[Req], num_decoding: int) -> list[tuple[Req, int]]:
        """(request, tokens to prefill now), oldest first, within ``batch_max_tokens`` and the
        pool's room less this step's decode tokens."""
        budget = self.limits.batch_max_tokens
        free = self.runner.slots.available - num_decoding
        chunks: list[tuple[Req, int]] = []
        for req in running:
            if budget <= 0:
                break
            if not req.is_prefilled:
                n = min(req.num_uncached, budget, free)
                if n <= 0:
                    break
                chunks.append((req, n))
                budget, free = budget - n, free - n
        return chunks


def slots_needed(running: list[Req], decoding: list[Req]) -> int:
    """Slots a step must have: one per decoding request, one for any prefill to progress."""
    return len(decoding) + any(not r.is_prefilled for r in running)
