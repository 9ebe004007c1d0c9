"""The continuous-batching engine: add, cancel, step.

Each step admits waiting requests that fit (prefilled together in one
forward), then decodes every running request by one token (a second
forward). Admission here is the worker's own check on its pool: the
conservative need (prompt + max_new_tokens) of everything running must fit,
so a running request can never run out of KV slots mid-generation.
Finished and cancelled requests free their slots the moment they end.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from shared.schemas import RequestStatus
from worker.events import Ended, Event, Released, Started, Token
from worker.request import Phase, Req


@dataclass(frozen=True)
class EngineLimits:
    max_total_tokens: int
    batch_max_tokens: int
    running_max_req_size: int


@dataclass(frozen=True)
class LoadSnapshot:
    used_tokens: int
    committed_tokens: int
    num_running: int
    num_waiting: int


class Engine:
    def __init__(self, runner, limits: EngineLimits, eos_ids: set[int]):
        self.runner = runner
        self.limits = limits
        self.eos_ids = eos_ids
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._committed = 0  # sum of max_tokens_needed over running + waiting
        self._lock = threading.Lock()  # guards the counters the heartbeat reads

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Req) -> None:
        with self._lock:
            self.waiting.append(req)
            self._committed += req.max_tokens_needed

    def requests(self) -> list[Req]:
        return [*self.running, *self.waiting]

    def snapshot(self) -> LoadSnapshot:
        with self._lock:
            return LoadSnapshot(self.runner.pool.num_used, self._committed, len(self.running), len(self.waiting))

    def cancel(self, req: Req) -> list[Event]:
        """End ``req`` now (wherever it is) and free its slots."""
        if req.phase is Phase.FINISHED:
            return []
        self._release(req, "cancelled")
        num_output = len(req.output_ids)
        return [Ended(req.id, RequestStatus.CANCELLED, "cancelled", num_output), Released(req.id, req.inbox_id)]

    def step(self) -> list[Event]:
        events: list[Event] = []
        admitted = self._admit()
        if admitted:
            events += [Started(r.id, r.msg.prompt_ids, r.msg.resume_ids) for r in admitted]
            events += self._forward(admitted, is_decode=False)
        decoding = [r for r in self.running if r.phase is Phase.RUNNING and r not in admitted]
        if decoding:
            events += self._forward(decoding, is_decode=True)
        return events

    def _admit(self) -> list[Req]:
        admitted: list[Req] = []
        running_need = sum(r.max_tokens_needed for r in self.running)
        prefill_tokens = 0
        while self.waiting:
            req = self.waiting[0]
            fits_pool = running_need + req.max_tokens_needed <= self.limits.max_total_tokens
            fits_batch = not admitted or prefill_tokens + req.num_tokens <= self.limits.batch_max_tokens
            fits_count = len(self.running) < self.limits.running_max_req_size
            if not (fits_pool and fits_batch and fits_count):
                break
            self.waiting.popleft()
            self.runner.start(req)
            req.phase = Phase.RUNNING
            self.running.append(req)
            admitted.append(req)
            running_need += req.max_tokens_needed
            prefill_tokens += req.num_tokens
        return admitted

    def _forward(self, reqs: list[Req], is_decode: bool) -> list[Event]:
        token_ids, logprobs = self.runner.forward(reqs, is_decode)
        events: list[Event] = []
        for req, token_id, logprob in zip(reqs, token_ids, logprobs):
            req.output_ids.append(token_id)
            reason = self._finish_reason(req, token_id)
            events.append(Token(req.id, len(req.output_ids) - 1, token_id, logprob, reason))
            if reason is not None:
                self._release(req, reason)
                events.append(Released(req.id, req.inbox_id))
        return events

    def _finish_reason(self, req: Req, token_id: int):
        if token_id in self.eos_ids and not req.msg.params.ignore_eos:
            return "stop"
        if req.is_done_generating:
            return "length"
        return None

    def _release(self, req: Req, reason) -> None:
        with self._lock:
            if req.phase is Phase.RUNNING:
                self.running.remove(req)
                self.runner.finish(req)
            else:
                self.waiting.remove(req)
            self._committed -= req.max_tokens_needed
            req.phase = Phase.FINISHED
            req.finish_reason = reason
