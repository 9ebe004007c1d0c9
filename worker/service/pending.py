"""What a publisher has made but not yet written (per request, its runs and status changes), and its flush.

Tokens wait here until their request's writes are flushed (``Pending.take``):
at once when the request is urgent (its first token of this attempt, an end,
a pause, a release: the time to first token and the end are never held
back), else every ``--stream_flush_ms``, when everything waiting goes in one
call. A request's writes keep their order: start, runs (one per sample, and a
sample's run is cut where it ends without a token), end, fence.

The flush (``FlushMixin``, the publisher's half that writes) takes what is
due and writes it in one call (``worker.service.chunk_writer``), retrying
through a Redis outage for as long as the worker lives and for a bounded time
once it is gone (``give_up_s``, else ``ORPHAN_RETRY_S``); then a request
refused (its epoch moved on) is forgotten, and a paused request, fenced by
that call, goes back to the ingress stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.chunk_schemas import ChunkRun
from shared.keys import WORKER_GROUP
from shared.redis import OUTAGES, Backoff
from shared.requeue import send_back
from shared.schemas import FinishReason, GenerateRequest
from worker.service.chunk_writer import RequestWrite, Written
from worker.service.texts import Sample

log = logging.getLogger("lightq.worker")

ORPHAN_RETRY_S = 20.0  # how long a write retries through an outage once the worker is gone

TopLogprobs = list[tuple[int, float]]
PromptLogprobs = list[tuple[float, TopLogprobs]]


@dataclass
class Run:
    """A sample's consecutive tokens, from ``index`` on."""

    choice: int
    index: int
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    tops: list[TopLogprobs | None] | None = None
    prompt: PromptLogprobs | None = None
    finished: bool = False
    reason: FinishReason | None = None
    error: str | None = None

    def add(self, token_id: int, text: str, logprob: float, top: TopLogprobs | None) -> None:
        if top is not None and self.tops is None:
            self.tops = [None] * len(self.token_ids)
        self.token_ids.append(token_id)
        self.texts.append(text)
        self.logprobs.append(logprob)
        if self.tops is not None:
            self.tops.append(top)

    def json(self, request_id: str) -> str:
        run = ChunkRun.model_construct(  # built whole here: validating it again costs per token
            kind="run",
            v=2,
            request_id=request_id,
            choice=self.choice,
            index=self.index,
            token_ids=self.token_ids,
            texts=self.texts,
            logprobs=self.logprobs,
            top_logprobs=self.tops,
            prompt_logprobs=self.prompt,
            finished=self.finished,
            finish_reason=self.reason,
            error=self.error,
        )
        return run.model_dump_json()


@dataclass
class Waiting:
    """One request's writes not yet flushed."""

    epoch: int
    since: float  # monotonic: when the first of them was made
    start: dict[str, str] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)
    open: dict[int, Run] = field(default_factory=dict)  # per sample: the run its next token joins
    end: dict[str, str] = field(default_factory=dict)
    preempted: tuple[GenerateRequest, str] | None = None  # (its message, inbox entry): fence, send it back
    urgent: bool = False

    def token(self, choice: int, index: int) -> Run:
        run = self.open.get(choice)
        if run is None:
            run = self.open[choice] = Run(choice, index)
            self.runs.append(run)
        return run

    def close(self, choice: int) -> None:
        self.open.pop(choice, None)

    def write(self, request_id: str, reply_to: str | None) -> RequestWrite:
        return RequestWrite(
            request_id,
            self.epoch,
            self.start,
            [run.json(request_id) for run in self.runs],
            self.end,
            self.preempted is not None,
            reply_to,
        )


class Pending:
    """Every request's waiting writes, and when they are due."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.waiting: dict[str, Waiting] = {}
        self.last_full = time.monotonic()

    def of(self, request_id: str, epoch: int) -> Waiting:
        found = self.waiting.get(request_id)
        if found is None:
            found = self.waiting[request_id] = Waiting(epoch, time.monotonic())
        return found

    def forget_older(self, request_id: str, epoch: int) -> None:
        """Drop the waiting writes of an older epoch of ``request_id`` (they would be refused)."""
        found = self.waiting.get(request_id)
        if found is not None and found.epoch != epoch:
            del self.waiting[request_id]

    def wait_s(self) -> float | None:
        """How long until the next flush is due (0: now; None: nothing waits)."""
        if not self.waiting:
            return None
        if any(w.urgent for w in self.waiting.values()):
            return 0.0
        return max(0.0, self.last_full + self.interval_s - time.monotonic())

    def take(self, everything: bool = False) -> list[tuple[str, Waiting]]:
        """The writes due now: all of them at the interval (or when ``everything``), else the urgent."""
        now = time.monotonic()
        if everything or now >= self.last_full + self.interval_s:
            self.last_full = now
            taken, self.waiting = list(self.waiting.items()), {}
            return taken
        taken = [(rid, w) for rid, w in self.waiting.items() if w.urgent]
        for rid, _ in taken:
            del self.waiting[rid]
        return taken

    def drop(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)


class FlushMixin:
    """``worker.service.publisher.Publisher``'s waiting writes to Redis: ``tagged``, ``wait_s`` and
    ``flush``. It works on the publisher's state (``pending``, ``writer``, ``requests``, ``finals``,
    ``texts``, ``fenced_out``, ``stop_epochs``, ``lengths``, ``released``, ``worker_alive``, ``client``,
    ``keys``, ``worker_id``), which ``Publisher.__init__`` makes."""

    def tagged(self, samples: list[Sample]) -> list[tuple[str, int, int]]:
        """``samples`` (stopped or refused) with their copy's epoch, for the serve loop."""
        tagged = [(rid, choice, self.stop_epochs.get(rid, 0)) for rid, choice in samples]
        for rid, _ in samples:
            self.stop_epochs.pop(rid, None)
        return tagged

    def wait_s(self) -> float | None:
        """How long the process may wait for more events before a flush is due (None: no limit)."""
        if self.released or self.lengths:
            return 0.0
        return self.pending.wait_s()

    def flush(self, everything: bool = False, give_up_s: float | None = None) -> list[Sample]:
        """Write what is due (all of it with ``everything``) in one call, retrying through a Redis
        outage: chunks are never dropped while the worker lives. A retry after a lost reply may
        repeat a run; readers drop repeated indexes. ``give_up_s`` (the worker is gone) bounds the
        retries: what is not written is sampled again by the worker its requests move to, so an
        orphan must not wait for a Redis that may never return. Returns the samples of requests
        refused (their epoch moved on), for the serve loop to free."""
        taken = self.pending.take(everything)
        if not taken and not self.released and not self.lengths:
            return []
        writes = [self._write(rid, waiting) for rid, waiting in taken]
        lengths, released, self.lengths, self.released = self.lengths, self.released, [], []
        results = self._send(lambda: self.writer.flush(writes, lengths, released), give_up_s, len(writes))
        if results is None:
            return []
        return self._settle(taken, writes, results, give_up_s)

    def _write(self, request_id: str, waiting: Waiting) -> RequestWrite:
        request = self.requests.get(request_id)
        if request is None:  # its last writes, after its release; or a request refused on arrival
            request = self.finals.pop(request_id, None)
            if request is None:
                return waiting.write(request_id, None)
        return waiting.write(request_id, request.reply_to)

    def _settle(
        self, taken: list[tuple[str, Waiting]], writes: list[RequestWrite], results: list[Written], give_up_s
    ) -> list[Sample]:
        refused: list[Sample] = []
        for (rid, waiting), write, result in zip(taken, writes, results):
            request = self.requests.get(rid)
            if request is not None and request.epoch != write.epoch:
                request = None  # a newer copy of the request runs here now: only the old one's writes went
            if not result.written:
                log.warning("%s moved on (epoch %d is no longer its own): nothing more is written", rid, write.epoch)
                if request is not None:  # the engine still runs it: it must be told
                    refused += [(rid, c) for c in request.choices]
                    self.stop_epochs[rid] = write.epoch
                    for choice in request.choices:
                        self.texts.drop((rid, choice))
                    self.requests.pop(rid)
                    self.fenced_out.add(rid)
                continue
            if waiting.preempted is not None:
                msg, inbox_id = waiting.preempted
                self._send(lambda m=msg, e=result.epoch, i=inbox_id: self._send_back(m, e, i), give_up_s, 1)
        return refused

    def _send_back(self, msg: GenerateRequest, epoch: int, inbox_id: str) -> None:
        """A paused request back to the queue with the epoch its fence took, then its inbox entry goes
        (a crash between the two leaves it in both: the janitor's requeue of the inbox makes a second
        ingress entry, which the router drops while the first is dispatched, router.dispatch)."""
        send_back(self.client, self.keys, msg, epoch)
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, inbox_id)
        pipe.xdel(self.keys.inbox(self.worker_id), inbox_id)
        pipe.execute()

    def _send(self, call: Callable, give_up_s: float | None, size: int):
        backoff = Backoff()
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        while True:
            try:
                return call()
            except OUTAGES as exc:
                if deadline is None and not self.worker_alive():
                    deadline = time.monotonic() + ORPHAN_RETRY_S
                if deadline is not None and time.monotonic() > deadline:
                    log.error("writing %d requests failed (%s): giving up, the worker is gone", size, exc)
                    return None
                log.warning("writing %d requests failed (%s): retrying in %.1f s", size, exc, backoff.delay)
                time.sleep(backoff.next())
