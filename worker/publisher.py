"""The publisher thread: detokenises and writes every chunk to Redis.

It runs beside the model loop (LightLLM's point: CPU work must not stall
the GPU). Per step it receives a batch of events, turns tokens into text
incrementally, and writes everything in one pipeline: chunk stream, pub/sub,
status hash; on a request's end the TTLs, the inbox ack and the output
length history. Events of one request arrive in order, so chunks do too.

Stop strings are matched here, on the text (``worker.stop``): a token whose
text completes one becomes the request's last chunk (finish_reason "stop",
text up to the stop string), and its id goes to ``take_stopped()`` so the
serve loop frees it; tokens the engine generates after that are dropped.
Every published token still gets its chunk (maybe with empty text while
text is held back), so chunk indexes stay one per token.

A group's samples (``choice`` 0..n-1) each have their own decoder and stop
matcher and write into the request's one chunk stream; the status hash
says finished (with the samples' total output tokens) when the last one
ends. Each sample's length joins the output-length history. A requeued
group's samples that had finished are not run again: its count starts
with their tokens and waits only for the others.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis

from shared.config import WorkerSettings
from shared.keys import WORKER_GROUP, Keys
from shared.redis import Backoff
from shared.request_log import append_chunk, mark_ended, now_ms
from shared.schemas import FinishReason, GenerateRequest, RequestMeta, RequestStatus, TokenChunk
from worker.detokenizer import IncrementalDecoder, resumed_decoder
from worker.events import Ended, Event, Released, Started, Token
from worker.stop import StopMatcher

log = logging.getLogger("lightq.worker")

OUTPUT_HISTORY_LEN = 1000


@dataclass
class _Output:
    """One running sample's text state on the publisher thread."""

    decoder: IncrementalDecoder
    matcher: StopMatcher
    min_new_tokens: int = 0


@dataclass
class _Group:
    """A group's samples still running here, and the output tokens of those that ended."""

    remaining: int
    num_output: int = 0


Sample = tuple[str, int]  # (request id, choice)


class Publisher:
    def __init__(self, settings: WorkerSettings, client: redis.Redis, tokenizer, worker_id: str):
        self.client = client
        self.keys = Keys(settings.redis.key_prefix)
        self.ttl_s = settings.redis.request_ttl_s
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.outputs: dict[Sample, _Output] = {}
        self.groups: dict[str, _Group] = {}  # requests with n > 1, from Started to their last sample's end
        # Samples a stop string finished while the engine still runs them: their later Token/Ended
        # events are dropped until the request's Released event (the engine's last for it).
        self.ended_by_stop: set[Sample] = set()
        self._stopped: list[Sample] = []  # for the serve loop to free; guarded by _stopped_lock
        self._stopped_lock = threading.Lock()
        self.inbox: queue.Queue[tuple[int, list[Event]] | None] = queue.Queue()  # (step end, its events)
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, events: list[Event]) -> None:
        """A step's events, stamped with the step's end (a request's ``stepped_ms``)."""
        if events:
            self.inbox.put((now_ms(), events))

    def take_stopped(self) -> list[Sample]:
        """(request id, choice) of samples a stop string ended since the last call (thread-safe).

        The serve loop frees each one's slots (the engine does not know it ended);
        whatever the engine emits for it meanwhile is dropped here.
        """
        with self._stopped_lock:
            stopped, self._stopped = self._stopped, []
        return stopped

    def close(self) -> None:
        """Publish everything queued, then stop."""
        self.inbox.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (item := self.inbox.get()) is not None:
            self.publish(item[1], item[0])

    def publish(self, events: list[Event], stepped_ms: int | None = None) -> None:
        """Turn events into Redis writes once (decoder state moves on exactly once),
        then send them, retrying through a Redis outage: chunks are never dropped.
        A retry after a partial write may repeat a chunk; readers drop repeated indexes."""
        pipe = _Recorder()
        self._record(events, pipe, stepped_ms)
        backoff = Backoff()
        while True:
            try:
                pipe.replay(self.client)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("publishing %d events failed (%s): retrying in %.1f s", len(events), exc, backoff.delay)
                time.sleep(backoff.next())

    def _record(self, events: list[Event], pipe, stepped_ms: int | None) -> None:
        for event in events:
            if isinstance(event, Started):
                self._started(pipe, event, stepped_ms)
            elif isinstance(event, Token):
                if (event.request_id, event.choice) not in self.ended_by_stop:
                    self._token(pipe, event)
            elif isinstance(event, Ended):
                sample = (event.request_id, event.choice)
                running = self.outputs.pop(sample, None) is not None
                # A group's sample that already ended (its last token) is not ended twice; a request
                # that never started here (refused on arrival) still gets its end.
                if sample not in self.ended_by_stop and (running or event.request_id not in self.groups):
                    append_chunk(pipe, self.keys, TokenChunk(
                        request_id=event.request_id, index=event.num_output, choice=event.choice, token_id=None,
                        finished=True, finish_reason=event.reason, error=event.error))
                    self._sample_ended(pipe, event.request_id, event.status, event.reason, event.num_output,
                                       event.error)
            elif isinstance(event, Released):
                self.ended_by_stop = {s for s in self.ended_by_stop if s[0] != event.request_id}
                self.groups.pop(event.request_id, None)
                pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, event.inbox_id)
                pipe.xdel(self.keys.inbox(self.worker_id), event.inbox_id)

    def _started(self, pipe, event: Started, stepped_ms: int | None) -> None:
        msg = event.msg
        for choice in msg.open_choices:  # each sample after the tokens it emitted before (resumed)
            emitted = msg.emitted(choice)
            matcher = StopMatcher(msg.params.stop_sequences)
            if matcher and emitted:
                decoder = self._replay(msg, emitted, matcher)
            else:
                decoder = resumed_decoder(self.tokenizer, msg.prompt_ids, emitted)
            self.outputs[(msg.id, choice)] = _Output(decoder, matcher, msg.params.min_new_tokens)
        if msg.n > 1:  # a requeued group's finished samples are counted already, not ended again
            self.groups[msg.id] = _Group(remaining=len(msg.open_choices),
                                         num_output=sum(len(msg.emitted(c)) for c in msg.finished_choices))
        pipe.hset(self.keys.meta(msg.id), mapping=RequestMeta.fields(
            status=RequestStatus.RUNNING, started_ms=now_ms(), worker=self.worker_id, taken_ms=event.taken_ms,
            stepped_ms=stepped_ms))

    def _replay(self, msg: GenerateRequest, emitted: list[int], matcher: StopMatcher) -> IncrementalDecoder:
        """Rebuild what the earlier attempt held back: same tokens, same pieces, same state.

        (Its emitted text is discarded; the client has it. A stop it had completed
        would have ended the request, so none completes here.)
        """
        decoder = IncrementalDecoder(self.tokenizer, msg.prompt_ids)
        for index, token_id in enumerate(emitted):
            matcher.push(decoder.push(token_id), armed=index + 1 >= msg.params.min_new_tokens)
        return decoder

    def _token(self, pipe, event: Token) -> None:
        sample = (event.request_id, event.choice)
        output = self.outputs[sample]
        text = output.decoder.push(event.token_id)
        reason = event.finish_reason
        if reason is not None:
            text += output.decoder.flush()
        stopped_here = False
        if output.matcher:
            text, hit = output.matcher.push(text, armed=event.index + 1 >= output.min_new_tokens)
            if hit:
                stopped_here = reason is None  # the engine still runs it: it must be told
                reason = "stop"
            elif reason is not None:
                text += output.matcher.flush()
        self._write_token(pipe, event, text, reason)
        if reason is not None:
            del self.outputs[sample]
        if stopped_here:
            self.ended_by_stop.add(sample)
            with self._stopped_lock:
                self._stopped.append(sample)

    def _write_token(self, pipe, event: Token, text: str, reason: FinishReason | None) -> None:
        finished = reason is not None
        append_chunk(pipe, self.keys, TokenChunk(
            request_id=event.request_id, index=event.index, choice=event.choice, token_id=event.token_id,
            text=text, logprob=event.logprob, top_logprobs=event.top, finished=finished, finish_reason=reason))
        num_output = event.index + 1
        if finished:
            pipe.lpush(self.keys.output_lengths(), num_output)
            pipe.ltrim(self.keys.output_lengths(), 0, OUTPUT_HISTORY_LEN - 1)
            self._sample_ended(pipe, event.request_id, RequestStatus.FINISHED, reason, num_output)
        elif event.request_id not in self.groups:  # a group's count is written once, at its end
            pipe.hset(self.keys.meta(event.request_id), "output_tokens", num_output)

    def _sample_ended(self, pipe, request_id: str, status: RequestStatus, reason: FinishReason,
                      num_output: int, error: str | None = None) -> None:
        """The request ends with its last sample: status, total output tokens, TTLs."""
        group = self.groups.get(request_id)
        if group is not None:
            group.remaining -= 1
            group.num_output += num_output
            if group.remaining > 0:
                return
            num_output = group.num_output
        mark_ended(pipe, self.keys, request_id, status=status, reason=reason, num_output=num_output,
                   ttl_s=self.ttl_s, error=error)


class _Recorder:
    """Stands in for a pipeline: records the calls, replays them on a fresh one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))

    def replay(self, client: redis.Redis) -> None:
        pipe = client.pipeline(transaction=False)
        for name, args, kwargs in self.calls:
            getattr(pipe, name)(*args, **kwargs)
        pipe.execute()
