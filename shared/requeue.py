"""Sending a worker's inbox back to the ingress stream: shared by the router
(a dead worker's inbox) and the worker itself (a graceful stop).

The request's durable chunk stream is the source of truth for what the
client already has: a request goes back with those tokens as
``resume_ids``, so the next worker continues after them and each output
index reaches the client once. The request is fenced first
(``shared.request_log.fence``): its old worker, or that worker's orphaned
publisher, can write nothing after the chunks are read, so they are exactly
what the next attempt continues after. Requests that already ended are left alone;
one whose status hash is gone or has no ``status`` (lost with an empty Redis)
ends ``failed``, so its readers get a final event and its keys a TTL.
A worker's death counts as an attempt of the requests it is blamed on:
the requests of the forward that raised (the worker says so as it fails),
or after a death without a word (killed) those of the dead worker's last
admission; a graceful hand-back counts against none. Every request running
through a death also counts it in ``deaths``; past ``DEATHS_PER_ATTEMPT``
times ``max_attempts`` it is dead-lettered too (one that kills workers in
a step it is not blamed for is stopped all the same).

A group (n > 1) goes back whole, with each sample's own progress: the
tokens each choice already emitted (``group_resume``) and the choices that
already finished (``finished_choices``). The next worker prefills the
prompt once, runs only the unfinished samples and continues each after its
own tokens, so every (choice, index) reaches the client once, with the
token it first got, whatever the numerics of the new batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shared.chunk_schemas import TokenChunk
from shared.chunks import emitted_chunks, has_ended
from shared.codec import FIELD, encode, entry, from_entry
from shared.keys import Keys
from shared.request_log import ENDED, LOST, end_request, fence, mark_finished, now_ms
from shared.schemas import DeadLetter, GenerateRequest, RequestStatus

DEATHS_PER_ATTEMPT = 2

# Back to the ingress (what shared.ingress.add does, in a script: only while the epoch is the one
# the requeue fenced with). KEYS: status hash, the class's ingress stream, the classes set.
# ARGV: epoch, priority, entry field, message, attempt. 1 sent; 0 refused (the epoch moved on).
SEND_BACK_LUA = """
if (redis.call('HGET', KEYS[1], 'epoch') or '0') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempt', ARGV[5])
redis.call('HDEL', KEYS[1], 'worker')
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
redis.call('XADD', KEYS[2], '*', ARGV[3], ARGV[4])
return 1
"""


@dataclass(frozen=True)
class Death:
    """A worker's death, as counted against the requests it held."""

    blamed: frozenset[str] = frozenset()  # their attempt counts it
    witnesses: frozenset[str] = frozenset()  # running too: their ``deaths`` count it (blamed ones' too)


def hand_back_inbox(
    client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, max_attempts: int, death: Death | None = None
) -> int:
    """Requeue every request in ``worker_id``'s inbox, deleting each entry; returns how many went
    back. ``death``: the worker died (None: a graceful hand-back, counted against nobody)."""
    requeued = 0
    for entry_id, fields in client.xrange(keys.inbox(worker_id)):
        request = from_entry(GenerateRequest, fields)
        requeued += requeue(client, keys, request, ttl_s, max_attempts, death)
        client.xdel(keys.inbox(worker_id), entry_id)
    return requeued


def requeue(
    client: redis.Redis, keys: Keys, request: GenerateRequest, ttl_s: int, max_attempts: int, death: Death | None = None
) -> int:
    """Send ``request`` back to the queue after the tokens its chunk stream holds (1), or end it
    (0): it ended already, it was cancelled, its record was lost, or it was dead-lettered (its
    workers' deaths were blamed on it ``max_attempts`` times, or it ran through too many)."""
    epoch = fence(client, keys, request.id)
    if epoch == ENDED:
        return 0
    chunks = emitted_chunks(client, keys, request.id)  # final: its holder is fenced out
    num_output = sum(1 for c in chunks if c.token_id is not None)
    blamed = death is not None and request.id in death.blamed
    ran = death is not None and (blamed or request.id in death.witnesses)
    attempt, deaths = request.attempt + blamed, request.deaths + ran
    if epoch == LOST:  # a record lost with an empty Redis: end it for its readers
        if not has_ended(chunks, request.n):
            end_request(
                client,
                keys,
                request.id,
                status=RequestStatus.FAILED,
                reason="error",
                num_output=num_output,
                ttl_s=ttl_s,
                error="the request's status record was lost",
            )
    elif has_ended(chunks, request.n):  # it ended (a format-1 writer's status write was lost)
        last = next((c.finish_reason for c in reversed(chunks) if c.finished), None)
        mark_finished(client, keys, request.id, reason=last or "stop", num_output=num_output, ttl_s=ttl_s)
    elif client.exists(keys.cancel(request.id)):
        end_request(
            client,
            keys,
            request.id,
            status=RequestStatus.CANCELLED,
            reason="cancelled",
            num_output=num_output,
            ttl_s=ttl_s,
            epoch=epoch,
        )
    elif attempt >= max_attempts:  # a request that keeps killing workers stops here
        reason = f"its worker died on each of {max_attempts} attempts"
        dead_letter(client, keys, request, reason, num_output, ttl_s, epoch)
    elif deaths >= DEATHS_PER_ATTEMPT * max_attempts:
        reason = f"{deaths} workers died while it ran on them"
        dead_letter(client, keys, request, reason, num_output, ttl_s, epoch)
    else:
        update = {"attempt": attempt, "deaths": deaths, **resume_fields(request, chunks)}
        return int(send_back(client, keys, request.model_copy(update=update), epoch))
    return 0


def send_back(client: redis.Redis, keys: Keys, request: GenerateRequest, epoch: int) -> bool:
    """``request`` (its resume fields set) queued again as a new ingress entry, if its epoch is
    still ``epoch`` (the one its taker fenced with). Also the path of a preempted request
    (the publisher's flush, ``worker.service.pending``), whose resume fields the worker knows exactly."""
    script = client.register_script(SEND_BACK_LUA)
    args = [epoch, request.priority, FIELD, encode(request), request.attempt]
    return bool(script(keys=[keys.meta(request.id), keys.requests(request.priority), keys.classes()], args=args))


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
    client: redis.Redis,
    keys: Keys,
    request: GenerateRequest,
    reason: str,
    num_output: int,
    ttl_s: int,
    epoch: int | None = None,
) -> bool:
    """End the request ``failed`` with the reason (refused, False, if its epoch moved on from
    ``epoch``), then park it in the dead-letter stream."""
    ended = end_request(
        client,
        keys,
        request.id,
        status=RequestStatus.FAILED,
        reason="error",
        num_output=num_output,
        ttl_s=ttl_s,
        error=f"dead-lettered: {reason}",
        epoch=epoch,
    )
    if ended:
        client.xadd(keys.dead_letters(), entry(DeadLetter(reason=reason, failed_ms=now_ms(), request=request)))
    return ended
