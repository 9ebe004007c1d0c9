"""What the publisher process does with the model loop's events: text and Redis writes.

It runs in a process of its own (``worker.service.publisher_process``; LightLLM's
point, CPU work must not stall the GPU, is about processes: a thread would
share the model loop's GIL). It receives the events of one or more steps
(several when it fell behind), turns tokens into text incrementally, and
writes everything in one pipeline: chunk stream and pub/sub per token, the
status hash when a request changes state (started, ended; never per
token), and on a request's end the TTLs, the inbox ack and the output
length history. Events of one request arrive in order, so chunks do too.

Stop strings are matched here, on the text (``worker.service.stop``): a token whose
text completes one becomes the request's last chunk (finish_reason "stop",
text up to the stop string), and ``publish`` returns its sample so the
serve loop frees it; tokens the engine generates after that are dropped.
Every published token still gets its chunk (maybe with empty text while
text is held back), so chunk indexes stay one per token.

A group's samples (``choice`` 0..n-1) each have their own decoder and stop
matcher and write into the request's one chunk stream; the status hash
says finished (with the samples' total output tokens) when the last one
ends. Each sample's length joins the output-length history. A requeued
group's samples that had finished are not run again: its count starts
with their tokens and waits only for the others.

A request paused for a better class (``Preempted``, ``worker.engine.preempt``)
goes back to the ingress stream in the same pipeline as its tokens, after
them, so its ``resume_ids`` are exactly the chunks written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from shared.config import WorkerSettings
from shared.keys import WORKER_GROUP
from shared.redis import Backoff
from shared.request_log import append_chunk, mark_ended, now_ms
from shared.requeue import send_back
from shared.schemas import FinishReason, GenerateRequest, RequestMeta, RequestStatus, TokenChunk
from worker.engine.events import Ended, Event, Preempted, Released, Started, Token, Tokens
from worker.service.detokenizer import IncrementalDecoder, resumed_decoder
from worker.service.stop import StopMatcher

log = logging.getLogger("lightq.worker")

OUTPUT_HISTORY_LEN = 1000
ORPHAN_RETRY_S = 20.0  # how long a write retries through an outage once the worker is gone


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
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.outputs: dict[Sample, _Output] = {}
        self.groups: dict[str, _Group] = {}  # requests with n > 1, from Started to their last sample's end
        # Samples a stop string finished while the engine still runs them: their later Token/Ended
        # events are dropped until the request's Released event (the engine's last for it).
        self.ended_by_stop: set[Sample] = set()

    def publish(self, steps: list[tuple[int, list[Event]]], give_up_s: float | None = None) -> list[Sample]:
        """Write the events of ``steps`` ((step end in Unix ms, its events), in order) in one
        pipeline; return the samples a stop string ended, for the serve loop to free.

        Events become Redis writes once (decoder state moves on exactly once), then are sent,
        retrying through a Redis outage: chunks are never dropped while the worker lives. A retry
        after a partial write may repeat a chunk; readers drop repeated indexes. ``give_up_s``
        (the worker is gone) bounds the retries: what is not written is sampled again by the
        worker its requests move to, so an orphan must not wait for a Redis that may never return."""
        pipe, stopped = _Recorder(), []
        for stepped_ms, events in steps:
            stopped += self._record(events, pipe, stepped_ms)
        backoff = Backoff()
        deadline = None if give_up_s is None else time.monotonic() + give_up_s
        while True:
            try:
                pipe.replay(self.client)
                return stopped
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if deadline is None and not self.worker_alive():
                    deadline = time.monotonic() + ORPHAN_RETRY_S
                if deadline is not None and time.monotonic() > deadline:
                    log.error("publishing %d writes failed (%s): giving up, the worker is gone", len(pipe.calls), exc)
                    return stopped
                log.warning("publishing %d writes failed (%s): retrying in %.1f s", len(pipe.calls), exc, backoff.delay)
                time.sleep(backoff.next())

    def _record(self, events: list[Event], pipe, stepped_ms: int | None) -> list[Sample]:
        stopped: list[Sample] = []
        for event in events:
            if isinstance(event, Tokens):
                stopped += self._tokens(pipe, event)
            elif not self.owns(event.request_id):
                continue
            elif isinstance(event, Started):
                self._started(pipe, event, stepped_ms)
            elif isinstance(event, Ended):
                sample = (event.request_id, event.choice)
                running = self.outputs.pop(sample, None) is not None
                # A group's sample that already ended (its last token) is not ended twice; a request
                # that never started here (refused on arrival) still gets its end.
                if sample not in self.ended_by_stop and (running or event.request_id not in self.groups):
                    append_chunk(
                        pipe,
                        self.keys,
                        TokenChunk(
                            request_id=event.request_id,
                            index=event.num_output,
                            choice=event.choice,
                            token_id=None,
                            finished=True,
                            finish_reason=event.reason,
                            error=event.error,
                        ),
                    )
                    self._sample_ended(
                        pipe, event.request_id, event.status, event.reason, event.num_output, event.error
                    )
            elif isinstance(event, Preempted):
                # After its tokens' chunks (this pipeline's order): the next attempt's resume_ids
                # are exactly what the client got. One a stop string ended here is simply done.
                self.outputs.pop((event.request_id, 0), None)
                if (event.request_id, 0) not in self.ended_by_stop:
                    send_back(pipe, self.keys, event.msg)
                self._release(pipe, event.request_id, event.inbox_id)
            elif isinstance(event, Released):
                self._release(pipe, event.request_id, event.inbox_id)
        return stopped

    def _release(self, pipe, request_id: str, inbox_id: str) -> None:
        self.ended_by_stop = {s for s in self.ended_by_stop if s[0] != request_id}
        self.groups.pop(request_id, None)
        pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, inbox_id)
        pipe.xdel(self.keys.inbox(self.worker_id), inbox_id)

    def _tokens(self, pipe, tokens: Tokens) -> list[Sample]:
        """This shard's rows of ``tokens``, in order; the samples a stop string ended."""
        stopped: list[Sample] = []
        for row, request_id in enumerate(tokens.request_ids):
            sample = (request_id, tokens.choices[row])
            if sample in self.ended_by_stop or not self.owns(request_id):
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
            if self._token(pipe, token):
                stopped.append(sample)
        return stopped

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
            self.groups[msg.id] = _Group(
                remaining=len(msg.open_choices), num_output=sum(len(msg.emitted(c)) for c in msg.finished_choices)
            )
        pipe.hset(
            self.keys.meta(msg.id),
            mapping=RequestMeta.fields(
                status=RequestStatus.RUNNING,
                started_ms=now_ms(),
                worker=self.worker_id,
                taken_ms=event.taken_ms,
                stepped_ms=stepped_ms,
            ),
        )

    def _replay(self, msg: GenerateRequest, emitted: list[int], matcher: StopMatcher) -> IncrementalDecoder:
        """Rebuild what the earlier attempt held back: same tokens, same pieces, same state.

        (Its emitted text is discarded; the client has it. A stop it had completed
        would have ended the request, so none completes here.)
        """
        decoder = IncrementalDecoder(self.tokenizer, msg.prompt_ids)
        for index, token_id in enumerate(emitted):
            matcher.push(decoder.push(token_id), armed=index + 1 >= msg.params.min_new_tokens)
        return decoder

    def _token(self, pipe, event: Token) -> bool:
        """Write one token's chunk; True when a stop string ended its sample here (the engine
        still runs it and must be told)."""
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
        return stopped_here

    def _write_token(self, pipe, event: Token, text: str, reason: FinishReason | None) -> None:
        finished = reason is not None
        append_chunk(
            pipe,
            self.keys,
            TokenChunk(
                request_id=event.request_id,
                index=event.index,
                choice=event.choice,
                token_id=event.token_id,
                text=text,
                logprob=event.logprob,
                top_logprobs=event.top,
                prompt_logprobs=event.prompt,
                finished=finished,
                finish_reason=reason,
            ),
        )
        num_output = event.index + 1
        if finished:
            pipe.lpush(self.keys.output_lengths(), num_output)
            pipe.ltrim(self.keys.output_lengths(), 0, OUTPUT_HISTORY_LEN - 1)
            self._sample_ended(pipe, event.request_id, RequestStatus.FINISHED, reason, num_output)
        # No status write per token: a running request's count is its chunk stream's (readers
        # take the larger of the two), and the status hash changes when the request's state does.

    def _sample_ended(
        self,
        pipe,
        request_id: str,
        status: RequestStatus,
        reason: FinishReason,
        num_output: int,
        error: str | None = None,
    ) -> None:
        """The request ends with its last sample: status, total output tokens, TTLs."""
        group = self.groups.get(request_id)
        if group is not None:
            group.remaining -= 1
            group.num_output += num_output
            if group.remaining > 0:
                return
            num_output = group.num_output
        mark_ended(
            pipe,
            self.keys,
            request_id,
            status=status,
            reason=reason,
            num_output=num_output,
            ttl_s=self.ttl_s,
            error=error,
        )


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
