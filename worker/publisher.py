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
from shared.request_log import append_chunk, end_request, mark_ended, now_ms
from shared.schemas import FinishReason, RequestMeta, RequestStatus, TokenChunk
from worker.detokenizer import IncrementalDecoder, resumed_decoder
from worker.events import Ended, Event, Released, Started, Token
from worker.stop import StopMatcher

log = logging.getLogger("lightq.worker")

OUTPUT_HISTORY_LEN = 1000


@dataclass
class _Output:
    """One running request's text state on the publisher thread."""

    decoder: IncrementalDecoder
    matcher: StopMatcher
    min_new_tokens: int = 0


class Publisher:
    def __init__(self, settings: WorkerSettings, client: redis.Redis, tokenizer, worker_id: str):
        self.client = client
        self.keys = Keys(settings.redis.key_prefix)
        self.ttl_s = settings.redis.request_ttl_s
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.outputs: dict[str, _Output] = {}
        # Requests a stop string finished while the engine still runs them: their later
        # Token/Ended events are dropped until their Released event (the engine's last).
        self.ended_by_stop: set[str] = set()
        self._stopped: list[str] = []  # for the serve loop to free; guarded by _stopped_lock
        self._stopped_lock = threading.Lock()
        self.inbox: queue.Queue[list[Event] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, events: list[Event]) -> None:
        if events:
            self.inbox.put(events)

    def take_stopped(self) -> list[str]:
        """Ids of requests a stop string ended since the last call (thread-safe).

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
        while (events := self.inbox.get()) is not None:
            self.publish(events)

    def publish(self, events: list[Event]) -> None:
        """Turn events into Redis writes once (decoder state moves on exactly once),
        then send them, retrying through a Redis outage: chunks are never dropped.
        A retry after a partial write may repeat a chunk; readers drop repeated indexes."""
        pipe = _Recorder()
        self._record(events, pipe)
        backoff = Backoff()
        while True:
            try:
                pipe.replay(self.client)
                return
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("publishing %d events failed (%s): retrying in %.1f s", len(events), exc, backoff.delay)
                time.sleep(backoff.next())

    def _record(self, events: list[Event], pipe) -> None:
        for event in events:
            if isinstance(event, Started):
                self._started(pipe, event)
            elif isinstance(event, Token):
                if event.request_id not in self.ended_by_stop:
                    self._token(pipe, event)
            elif isinstance(event, Ended):
                self.outputs.pop(event.request_id, None)
                if event.request_id not in self.ended_by_stop:
                    end_request(pipe, self.keys, event.request_id, status=event.status, reason=event.reason,
                                num_output=event.num_output, ttl_s=self.ttl_s, error=event.error)
            elif isinstance(event, Released):
                self.ended_by_stop.discard(event.request_id)
                pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, event.inbox_id)
                pipe.xdel(self.keys.inbox(self.worker_id), event.inbox_id)

    def _started(self, pipe, event: Started) -> None:
        matcher = StopMatcher(event.stop_sequences)
        if matcher and event.resume_ids:
            decoder = self._replay(event, matcher)
        else:
            decoder = resumed_decoder(self.tokenizer, event.prompt_ids, event.resume_ids)
        self.outputs[event.request_id] = _Output(decoder, matcher, event.min_new_tokens)
        pipe.hset(self.keys.meta(event.request_id), mapping=RequestMeta.fields(
            status=RequestStatus.RUNNING, started_ms=now_ms(), worker=self.worker_id))

    def _replay(self, event: Started, matcher: StopMatcher) -> IncrementalDecoder:
        """Rebuild what the earlier attempt held back: same tokens, same pieces, same state.

        (Its emitted text is discarded; the client has it. A stop it had completed
        would have ended the request, so none completes here.)
        """
        decoder = IncrementalDecoder(self.tokenizer, event.prompt_ids)
        for index, token_id in enumerate(event.resume_ids):
            matcher.push(decoder.push(token_id), armed=index + 1 >= event.min_new_tokens)
        return decoder

    def _token(self, pipe, event: Token) -> None:
        output = self.outputs[event.request_id]
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
            del self.outputs[event.request_id]
        if stopped_here:
            self.ended_by_stop.add(event.request_id)
            with self._stopped_lock:
                self._stopped.append(event.request_id)

    def _write_token(self, pipe, event: Token, text: str, reason: FinishReason | None) -> None:
        finished = reason is not None
        append_chunk(pipe, self.keys, TokenChunk(
            request_id=event.request_id, index=event.index, token_id=event.token_id, text=text,
            logprob=event.logprob, finished=finished, finish_reason=reason))
        num_output = event.index + 1
        if finished:
            mark_ended(pipe, self.keys, event.request_id, status=RequestStatus.FINISHED,
                       reason=reason, num_output=num_output, ttl_s=self.ttl_s)
            pipe.lpush(self.keys.output_lengths(), num_output)
            pipe.ltrim(self.keys.output_lengths(), 0, OUTPUT_HISTORY_LEN - 1)
        else:
            pipe.hset(self.keys.meta(event.request_id), "output_tokens", num_output)


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
