"""What the publisher process does with the model loop's events: text, and runs of chunks in Redis.

It runs in a process of its own (``worker.service.publisher_process``; LightLLM's
point, CPU work must not stall the GPU, is about processes: a thread would
share the model loop's GIL). It receives the events of one or more steps
(several when it fell behind), turns tokens into text incrementally, and
keeps them as runs (``worker.service.pending``) until they are due; then one
round trip (``worker.service.chunk_writer``) writes every due request's
start, runs and end, each checked against the request's epoch. Events of
one request arrive in order, and its writes keep that order.

Stop strings are matched on the text (``worker.service.texts``): a token whose
text completes one becomes the request's last token, and ``record`` returns
its sample so the serve loop frees it; tokens the engine generates after
that are dropped. Every published token still has its place in a run (maybe
with empty text while text is held back), so indexes stay one per token.

A group's samples (``choice`` 0..n-1) each have their own decoder and stop
matcher and write into the request's one chunk stream; the status hash
says finished (with the samples' total output tokens) when the last one
ends. Each sample's length joins the output-length history. A requeued
group's samples that had finished are not run again: its count starts
with their tokens and waits only for the others.

A request paused for a better class (``Preempted``, ``worker.engine.preempt``)
is fenced after its last run (a new epoch, in the same call) and sent back
to the ingress stream with it, so its ``resume_ids`` are exactly the tokens
written. A request whose epoch moved on (the pool gave it to another
worker) gets nothing written: ``flush`` returns its samples, for the serve
loop to free, and its later events are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from shared.request_log import now_ms
from shared.schemas import FinishReason, GenerateRequest, RequestMeta, RequestStatus
from shared.worker_settings import WorkerSettings
from worker.engine.events import Ended, Event, Preempted, Released, Started, Token, Tokens
from worker.service.chunk_writer import ChunkWriter
from worker.service.pending import FlushMixin, Pending, Waiting
from worker.service.texts import Sample, Texts

OUTPUT_HISTORY_LEN = 1000


@dataclass
class _Request:
    """A request running here: its epoch, who listens, and a group's samples still running."""

    epoch: int
    choices: list[int]  # the samples it runs here
    is_group: bool
    reply_to: str | None
    remaining: int  # samples not ended yet
    num_output: int = 0  # tokens of the samples that ended
    first_out: bool = False  # a token of this attempt is waiting or written
    ended: dict[int, int] = field(default_factory=dict)  # choice -> tokens written, of the samples that ended


class Publisher(FlushMixin):
    """A publisher process's state, and ``record``: events into waiting writes. Its flush to Redis
    (``tagged``, ``wait_s``, ``flush``) is ``FlushMixin``'s, in ``worker.service.pending``."""

    def __init__(
        self,
        settings: WorkerSettings,
        client: redis.Redis,
        tokenizer,
        worker_id: str,
        owns: Callable[[str], bool] = lambda request_id: True,
        worker_alive: Callable[[], bool] = lambda: True,
    ):
        self.owns = owns  # whether this publisher writes a request (one shard of several; all by default)
        self.worker_alive = worker_alive  # False once the worker is gone: retries are bounded then
        self.client = client
        self.keys = settings.redis.keys
        self.ttl_s = settings.redis.request_ttl_s
        self.worker_id = worker_id
        self.writer = ChunkWriter(client, self.keys, worker_id, self.ttl_s, OUTPUT_HISTORY_LEN)
        self.pending = Pending(settings.stream_flush_ms / 1000)
        self.texts = Texts(tokenizer)
        self.requests: dict[str, _Request] = {}  # from Started to Released
        # Samples a stop string finished while the engine still runs them, and requests whose epoch
        # moved on: their later events are dropped until the request's Released event.
        self.ended_by_stop: set[Sample] = set()
        self.fenced_out: set[str] = set()
        # The epoch of each request whose samples were last reported stopped or refused: the serve loop
        # frees only that copy (a newer copy of the request may run there by the time it reads them).
        self.stop_epochs: dict[str, int] = {}
        self.finals: dict[str, _Request] = {}  # a released request's state, until its last write (wakes)
        self.lengths: list[int] = []  # output lengths of samples that ended, for the history
        self.released: list[str] = []  # inbox entries to acknowledge and delete

    # ---- events -> waiting writes -------------------------------------------------------------

    def record(self, steps: list[tuple[int, list[Event]]]) -> list[Sample]:
        """Take the events of ``steps`` ((step end in Unix ms, its events), in order); return the
        samples a stop string ended, for the serve loop to free. Decoder state moves on exactly once."""
        stopped: list[Sample] = []
        for stepped_ms, events in steps:
            for event in events:
                if isinstance(event, Tokens):
                    stopped += self._tokens(event)
                elif not self.owns(event.request_id):
                    continue
                elif isinstance(event, Started):
                    self._started(event, stepped_ms)
                elif event.request_id in self.fenced_out:
                    if isinstance(event, (Released, Preempted)):
                        self._release(event.request_id, event.inbox_id)
                elif isinstance(event, Ended):
                    self._ended(event)
                elif isinstance(event, Preempted):
                    self._preempted(event)
                elif isinstance(event, Released):
                    self._release(event.request_id, event.inbox_id)
        return stopped

    def _started(self, event: Started, stepped_ms: int | None) -> None:
        msg = event.msg
        self.fenced_out.discard(msg.id)
        self.texts.start(msg)
        # A requeued group's finished samples are counted already, not ended again.
        done = sum(len(msg.emitted(c)) for c in msg.finished_choices)
        self.requests[msg.id] = _Request(
            event.epoch, msg.open_choices, msg.n > 1, msg.reply_to, len(msg.open_choices), done
        )
        self.pending.forget_older(msg.id, event.epoch)  # an older copy's writes: refused anyway
        waiting = self.pending.of(msg.id, event.epoch)
        waiting.start = RequestMeta.fields(
            status=RequestStatus.RUNNING,
            started_ms=now_ms(),
            worker=self.worker_id,
            taken_ms=event.taken_ms,
            stepped_ms=stepped_ms,
        )

    def _tokens(self, tokens: Tokens) -> list[Sample]:
        """This shard's rows of ``tokens``, in order; the samples a stop string ended."""
        stopped: list[Sample] = []
        for row, request_id in enumerate(tokens.request_ids):
            sample = (request_id, tokens.choices[row])
            if sample in self.ended_by_stop or request_id in self.fenced_out or not self.owns(request_id):
                continue
            token = Token(
                request_id,
                tokens.indexes[row],
                tokens.token_ids[row],
                tokens.logprobs[row],
                tokens.reasons.get(row),
                sample[1],
                tokens.tops.get(row),
                tokens.prompts.get(row),
            )
            if self._token(token):
                stopped.append(sample)
                self.stop_epochs[request_id] = self.requests[request_id].epoch
        return stopped

    def _token(self, event: Token) -> bool:
        """Add one token to its sample's run; True when a stop string ended its sample here (the
        engine still runs it and must be told)."""
        text = self.texts.token(event)
        request = self.requests[event.request_id]
        waiting = self.pending.of(event.request_id, request.epoch)
        run = waiting.token(event.choice, event.index)
        run.add(event.token_id, text.text, event.logprob, event.top)
        if event.prompt is not None:
            run.prompt = event.prompt
        if not request.first_out:  # this attempt's first token: the time to first token is not held back
            request.first_out = waiting.urgent = True
        if text.reason is not None:
            request.ended[event.choice] = event.index + 1
            run.finished, run.reason = True, text.reason
            waiting.close(event.choice)
            self.lengths.append(event.index + 1)
            self._sample_ended(waiting, event.request_id, RequestStatus.FINISHED, text.reason, event.index + 1)
        if text.stopped_here:
            self.ended_by_stop.add((event.request_id, event.choice))
        return text.stopped_here

    def _ended(self, event: Ended) -> None:
        """A sample that stopped without a final token (cancelled, failed): a run of its own."""
        sample = (event.request_id, event.choice)
        running = self.texts.drop(sample)
        request = self.requests.get(event.request_id)
        # A group's sample that already ended (its last token) is not ended twice; a request that
        # never started here (refused on arrival) still gets its end.
        if sample in self.ended_by_stop or not (running or request is None or not request.is_group):
            return
        epoch = request.epoch if request is not None else event.epoch
        waiting = self.pending.of(event.request_id, epoch)
        waiting.close(event.choice)
        end = waiting.token(event.choice, event.num_output)
        end.finished, end.reason, end.error = True, event.reason, event.error
        waiting.close(event.choice)
        self._sample_ended(waiting, event.request_id, event.status, event.reason, event.num_output, event.error)

    def _sample_ended(
        self,
        waiting: Waiting,
        request_id: str,
        status: RequestStatus,
        reason: FinishReason,
        num_output: int,
        error: str | None = None,
    ) -> None:
        """The request ends with its last sample: status, total output tokens, TTLs."""
        waiting.urgent = True
        request = self.requests.get(request_id)
        if request is not None:
            request.remaining -= 1
            request.num_output += num_output
            if request.remaining > 0:
                return
            num_output = request.num_output
        waiting.end = RequestMeta.fields(
            status=status, finish_reason=reason, output_tokens=num_output, finished_ms=now_ms(), error=error
        )

    def _preempted(self, event: Preempted) -> None:
        """After its tokens' runs (this request's write order), a new epoch, then back to the queue."""
        request = self.requests.get(event.request_id)
        msg: GenerateRequest | None = event.msg
        if request is not None:
            for choice in request.choices:
                self.texts.drop((event.request_id, choice))
            msg = resumable(event.msg, request)
        if msg is None:  # every sample ended here (a stop string the engine was not told of yet): done
            self._release(event.request_id, event.inbox_id)
            return
        # One that never started here has no Started: its fence takes the dispatch's epoch.
        waiting = self.pending.of(event.request_id, event.epoch if request is None else request.epoch)
        waiting.preempted = (msg, event.inbox_id)
        waiting.urgent = True
        self._forget(event.request_id)

    def _release(self, request_id: str, inbox_id: str) -> None:
        """Its inbox entry goes with the next flush (also a fenced-out request's: harmless if gone)."""
        self.released.append(inbox_id)
        waiting = self.pending.waiting.get(request_id)
        if waiting is not None:
            waiting.urgent = True
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.ended_by_stop = {s for s in self.ended_by_stop if s[0] != request_id}
        self.fenced_out.discard(request_id)
        request = self.requests.pop(request_id, None)
        if request is not None and request_id in self.pending.waiting:
            self.finals[request_id] = request  # its last writes still wake its producer


def resumable(msg: GenerateRequest, request: _Request) -> GenerateRequest | None:
    """``msg``, as the engine handed a paused request back, with the samples this publisher ended
    finished at their last written token (a stop string ends a sample here before the engine
    hears of it, and the engine's output runs on past it); None when every sample ended: the
    request ended, and nothing goes back."""
    if request.remaining == 0:
        return None
    if not request.is_group or not request.ended:
        return msg
    emitted = [list(msg.emitted(c)) for c in range(msg.n)]
    for choice, length in request.ended.items():
        emitted[choice] = emitted[choice][:length]
    finished = sorted({*msg.finished_choices, *request.ended})
    return msg.model_copy(update={"group_resume": emitted, "finished_choices": finished})
