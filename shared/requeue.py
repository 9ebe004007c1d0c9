"""Sending a worker's inbox back to the ingress stream: shared by the router
(a dead worker's inbox) and the worker itself (a graceful stop).

The request's durable chunk stream is the source of truth for what the
client already has: a request goes back with those tokens as
``resume_ids``, so the next worker continues after them and each output
index reaches the client once. Requests that already ended are left alone;
one whose status hash is gone or has no ``status`` (lost with an empty Redis)
ends ``failed``, so its readers get a final event and its keys a TTL.
A death counts as an attempt; a graceful hand-back does not.

A group (n > 1) goes back whole, with each sample's own progress: the
tokens each choice already emitted (``group_resume``) and the choices that
already finished (``finished_choices``). The next worker prefills the
prompt once, runs only the unfinished samples and continues each after its
own tokens, so every (choice, index) reaches the client once, with the
token it first got, whatever the numerics of the new batch.
"""

from __future__ import annotations

import redis

from shared import ingress
from shared.codec import entry, from_entry
from shared.keys import Keys
from shared.request_log import emitted_chunks, end_request, has_ended, mark_ended, now_ms
from shared.schemas import DeadLetter, GenerateRequest, RequestMeta, RequestStatus, TokenChunk


def hand_back_inbox(
    client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, max_attempts: int, count_attempt: bool
) -> int:
    """Requeue every request in ``worker_id``'s inbox, deleting each entry; returns how many went back."""
    requeued = 0
    for entry_id, fields in client.xrange(keys.inbox(worker_id)):
        request = from_entry(GenerateRequest, fields)
        requeued += requeue(client, keys, request, ttl_s, max_attempts, count_attempt)
        client.xdel(keys.inbox(worker_id), entry_id)
    return requeued


def requeue(
    client: redis.Redis, keys: Keys, request: GenerateRequest, ttl_s: int, max_attempts: int, count_attempt: bool = True
) -> int:
    raw = client.hgetall(keys.meta(request.id))
    if raw and "status" in raw and RequestMeta.from_hash(raw).status.is_terminal:
        return 0
    chunks = emitted_chunks(client, keys, request.id)
    if "status" not in raw and has_ended(chunks, request.n):
        return 0  # ended long ago, its record expired: nothing to do
    tokens = [c.token_id for c in chunks if c.token_id is not None]
    attempt = request.attempt + 1 if count_attempt else request.attempt
    pipe = client.pipeline(transaction=True)
    if "status" not in raw:  # its record was lost (a Redis that came back empty): end it for its readers
        end_request(
            pipe,
            keys,
            request.id,
            status=RequestStatus.FAILED,
            reason="error",
            num_output=len(tokens),
            ttl_s=ttl_s,
            error="the request's status record was lost",
        )
    elif has_ended(chunks, request.n):  # it ended; only the status write was lost
        mark_ended(
            pipe,
            keys,
            request.id,
            status=RequestStatus.FINISHED,
            reason=chunks[-1].finish_reason or "stop",
            num_output=len(tokens),
            ttl_s=ttl_s,
        )
    elif client.exists(keys.cancel(request.id)):
        end_request(
            pipe,
            keys,
            request.id,
            status=RequestStatus.CANCELLED,
            reason="cancelled",
            num_output=len(tokens),
            ttl_s=ttl_s,
        )
    elif attempt >= max_attempts:  # a request that keeps killing workers stops here
        dead_letter(pipe, keys, request, f"its worker died on each of {max_attempts} attempts", len(tokens), ttl_s)
    else:
        send_back(pipe, keys, request.model_copy(update={"attempt": attempt, **resume_fields(request, chunks)}))
        pipe.execute()
        return 1
    pipe.execute()
    return 0


def send_back(pipe: redis.client.Pipeline, keys: Keys, request: GenerateRequest) -> None:
    """``request`` (its resume fields set) queued again as a new ingress entry. Also the path of a
    preempted request (``worker.service.publisher``), whose resume fields the worker knows exactly."""
    pipe.hset(keys.meta(request.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, attempt=request.attempt))
    pipe.hdel(keys.meta(request.id), "worker")
    ingress.add(pipe, keys, request)  # its class's stream


def resume_fields(request: GenerateRequest, chunks: list[TokenChunk]) -> dict[str, list[int] | list[list[int]]]:
    """The message fields that make the next attempt continue after ``chunks`` (the request's
    de-duplicated chunks, ``emitted_chunks``, of a request that has not ended): ``resume_ids``
    for a single request; per choice its tokens and the finished choices for a group."""
    if request.n == 1:
        return {"resume_ids": [c.token_id for c in chunks if c.token_id is not None]}
    emitted: list[list[int]] = [[] for _ in range(request.n)]
    for chunk in chunks:  # by choice, then index: each choice's tokens in order
        if chunk.token_id is not None:
            emitted[chunk.choice].append(chunk.token_id)
    # Only a chunk with a token ends one choice (a tokenless one ends the whole request).
    finished = sorted({c.choice for c in chunks if c.finished and c.token_id is not None})
    return {"resume_ids": [], "group_resume": emitted, "finished_choices": finished}


def dead_letter(
    pipe: redis.client.Pipeline, keys: Keys, request: GenerateRequest, reason: str, num_output: int, ttl_s: int
) -> None:
    """Park the request in the dead-letter stream and end it ``failed`` with the reason."""
    pipe.xadd(keys.dead_letters(), entry(DeadLetter(reason=reason, failed_ms=now_ms(), request=request)))
    end_request(
        pipe,
        keys,
        request.id,
        status=RequestStatus.FAILED,
        reason="error",
        num_output=num_output,
        ttl_s=ttl_s,
        error=f"dead-lettered: {reason}",
    )
