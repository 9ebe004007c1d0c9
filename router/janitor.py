"""Re-dispatch what a dead worker held.

A worker whose load record expired is dead. Every request still in its
inbox that has not ended goes back onto the ingress stream with the tokens
it already emitted as ``resume_ids``, so the next worker continues where the
dead one stopped and the client's stream carries each index once. A request
whose workers died ``max_attempts`` times goes to the dead-letter stream and
ends ``failed`` (a poison request must not take the whole pool down). A lock
key makes sure only one router reaps a given worker.
"""

from __future__ import annotations

import logging

import redis

from shared.codec import entry, from_entry
from shared.keys import Keys
from shared.request_log import emitted_chunks, end_request, mark_ended, now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus

log = logging.getLogger("lightq.router")


def reap_dead_worker(client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, max_attempts: int = 3) -> int:
    """Requeue a dead worker's unfinished requests; returns how many went back."""
    if not client.set(keys.reap_lock(worker_id), "1", nx=True, ex=60):
        return 0
    requeued = 0
    for _, fields in client.xrange(keys.inbox(worker_id)):
        request = from_entry(GenerateRequest, fields)
        requeued += requeue(client, keys, request, ttl_s, max_attempts)
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.inbox(worker_id))
    pipe.zrem(keys.workers(), worker_id)
    pipe.execute()
    log.warning("worker %s is dead: %d requests dispatched again", worker_id, requeued)
    return requeued


def requeue(client: redis.Redis, keys: Keys, request: GenerateRequest, ttl_s: int, max_attempts: int = 3) -> int:
    raw = client.hgetall(keys.meta(request.id))
    if not raw or RequestMeta.from_hash(raw).status.is_terminal:
        return 0
    chunks = emitted_chunks(client, keys, request.id)
    tokens = [c.token_id for c in chunks if c.token_id is not None]
    pipe = client.pipeline(transaction=True)
    if chunks and chunks[-1].finished:  # it ended; only the status write was lost
        mark_ended(pipe, keys, request.id, status=RequestStatus.FINISHED,
                   reason=chunks[-1].finish_reason or "stop", num_output=len(tokens), ttl_s=ttl_s)
    elif client.exists(keys.cancel(request.id)):
        end_request(pipe, keys, request.id, status=RequestStatus.CANCELLED, reason="cancelled",
                    num_output=len(tokens), ttl_s=ttl_s)
    elif request.attempt + 1 >= max_attempts:  # a request that keeps killing workers stops here
        dead_letter(pipe, keys, request, f"its worker died on each of {max_attempts} attempts", len(tokens), ttl_s)
    else:
        again = request.model_copy(update={"attempt": request.attempt + 1,
                                           "resume_ids": tokens})
        pipe.hset(keys.meta(request.id), mapping=RequestMeta.fields(
            status=RequestStatus.QUEUED, attempt=again.attempt))
        pipe.hdel(keys.meta(request.id), "worker")
        pipe.xadd(keys.requests(), entry(again))
        pipe.execute()
        return 1
    pipe.execute()
    return 0


def dead_letter(pipe: redis.client.Pipeline, keys: Keys, request: GenerateRequest, reason: str,
                num_output: int, ttl_s: int) -> None:
    """Park the request in the dead-letter stream and end it ``failed`` with the reason."""
    pipe.xadd(keys.dead_letters(), {**entry(request), "reason": reason, "failed_ms": str(now_ms())})
    end_request(pipe, keys, request.id, status=RequestStatus.FAILED, reason="error", num_output=num_output,
                ttl_s=ttl_s, error=f"dead-lettered: {reason}")
