"""The publisher thread: detokenises and writes every chunk to Redis.

It runs beside the model loop (LightLLM's point: CPU work must not stall
the GPU). Per step it receives a batch of events, turns tokens into text
incrementally, and writes everything in one pipeline: chunk stream, pub/sub,
status hash; on a request's end the TTLs, the inbox ack and the output
length history. Events of one request arrive in order, so chunks do too.
"""

from __future__ import annotations

import logging
import queue
import threading

import redis

from shared.config import WorkerSettings
from shared.keys import WORKER_GROUP, Keys
from shared.request_log import append_chunk, end_request, mark_ended, now_ms
from shared.schemas import RequestMeta, RequestStatus, TokenChunk
from worker.detokenizer import IncrementalDecoder, resumed_decoder
from worker.events import Ended, Event, Released, Started, Token

log = logging.getLogger("lightq.worker")

OUTPUT_HISTORY_LEN = 1000


class Publisher:
    def __init__(self, settings: WorkerSettings, client: redis.Redis, tokenizer, worker_id: str):
        self.client = client
        self.keys = Keys(settings.redis.key_prefix)
        self.ttl_s = settings.redis.request_ttl_s
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.decoders: dict[str, IncrementalDecoder] = {}
        self.inbox: queue.Queue[list[Event] | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="publisher", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, events: list[Event]) -> None:
        if events:
            self.inbox.put(events)

    def close(self) -> None:
        """Publish everything queued, then stop."""
        self.inbox.put(None)
        self.thread.join()

    def _run(self) -> None:
        while (events := self.inbox.get()) is not None:
            try:
                self.publish(events)
            except redis.RedisError:
                log.exception("publishing %d events failed", len(events))

    def publish(self, events: list[Event]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for event in events:
            if isinstance(event, Started):
                self._started(pipe, event)
            elif isinstance(event, Token):
                self._token(pipe, event)
            elif isinstance(event, Ended):
                self.decoders.pop(event.request_id, None)
                end_request(pipe, self.keys, event.request_id, status=event.status, reason=event.reason,
                            num_output=event.num_output, ttl_s=self.ttl_s, error=event.error)
            elif isinstance(event, Released):
                pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, event.inbox_id)
                pipe.xdel(self.keys.inbox(self.worker_id), event.inbox_id)
        pipe.execute()

    def _started(self, pipe, event: Started) -> None:
        self.decoders[event.request_id] = resumed_decoder(self.tokenizer, event.prompt_ids, event.resume_ids)
        pipe.hset(self.keys.meta(event.request_id), mapping=RequestMeta.fields(
            status=RequestStatus.RUNNING, started_ms=now_ms(), worker=self.worker_id))

    def _token(self, pipe, event: Token) -> None:
        decoder = self.decoders[event.request_id]
        text = decoder.push(event.token_id)
        finished = event.finish_reason is not None
        if finished:
            text += decoder.flush()
            del self.decoders[event.request_id]
        append_chunk(pipe, self.keys, TokenChunk(
            request_id=event.request_id, index=event.index, token_id=event.token_id, text=text,
            logprob=event.logprob, finished=finished, finish_reason=event.finish_reason))
        num_output = event.index + 1
        if finished:
            mark_ended(pipe, self.keys, event.request_id, status=RequestStatus.FINISHED,
                       reason=event.finish_reason, num_output=num_output, ttl_s=self.ttl_s)
            pipe.lpush(self.keys.output_lengths(), num_output)
            pipe.ltrim(self.keys.output_lengths(), 0, OUTPUT_HISTORY_LEN - 1)
        else:
            pipe.hset(self.keys.meta(event.request_id), "output_tokens", num_output)
