"""What a publisher has made but not yet written: per request, its runs and status changes.

Tokens wait here until their request's writes are flushed (``Pending.take``):
at once when the request is urgent (its first token of this attempt, an end,
a pause, a release: the time to first token and the end are never held
back), else every ``--stream_flush_ms``, when everything waiting goes in one
call. A request's writes keep their order: start, runs (one per sample, and a
sample's run is cut where it ends without a token), end, fence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.chunk_schemas import ChunkRun
from shared.schemas import FinishReason, GenerateRequest
from worker.service.chunk_writer import RequestWrite

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
