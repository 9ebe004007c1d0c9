"""Re-dispatch what a dead worker held.

A worker whose load record expired is dead. Every request still in its
inbox that has not ended goes back onto the ingress stream with the tokens
it already emitted (``shared.requeue``); one whose workers' deaths were
blamed on it ``max_attempts`` times goes to the dead-letter stream and ends
``failed``, so a poison request cannot take the whole pool down. A lock key
makes sure only one router reaps a given worker.

A worker that died without a word (killed, out of memory) says nothing of
the step that killed it, so the death is blamed on the requests of its last
admission: those running there (their status was set before their first
forward) with the newest ``stepped_ms``. A request that kills workers is
newest where it kills them at its prefill, and a blamed request prefills
alone from then on (``worker.engine.admission``), so the next death is its
alone; the other requests running there count it only as a death they ran
through. (A worker that raised blames the forward that raised, itself.)
"""

from __future__ import annotations

import logging

import redis

from shared.codec import from_entry
from shared.keys import Keys
from shared.requeue import Death, hand_back_inbox
from shared.schemas import GenerateRequest, RequestStatus

log = logging.getLogger("lightq.router")


def reap_dead_worker(client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, max_attempts: int = 3) -> int:
    """Requeue a dead worker's unfinished requests; returns how many went back."""
    if not client.set(keys.reap_lock(worker_id), "1", nx=True, ex=60):
        return 0
    try:
        death = last_admission(client, keys, worker_id)
        requeued = hand_back_inbox(client, keys, worker_id, ttl_s, max_attempts, death)
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.inbox(worker_id))
        pipe.zrem(keys.workers(), worker_id)
        pipe.execute()
    finally:
        # Held only while reaping (the TTL covers a router that dies here): a worker that comes back
        # (it was cut off or frozen) and dies again is reaped again at once, not a minute later.
        client.delete(keys.reap_lock(worker_id))
    if requeued:
        log.warning("worker %s is gone: %d requests dispatched again", worker_id, requeued)
    if death.blamed:
        log.warning("worker %s died with %s newest: its death is counted against them", worker_id, sorted(death.blamed))
    return requeued


def last_admission(client: redis.Redis, keys: Keys, worker_id: str) -> Death:
    """The requests running on the dead worker, blamed: those of its newest ``stepped_ms``."""
    ids = [from_entry(GenerateRequest, fields).id for _, fields in client.xrange(keys.inbox(worker_id))]
    pipe = client.pipeline(transaction=False)
    for request_id in ids:
        pipe.hmget(keys.meta(request_id), "status", "worker", "stepped_ms")
    running = {
        request_id: int(stepped or 0)
        for request_id, (status, worker, stepped) in zip(ids, pipe.execute())
        if status == RequestStatus.RUNNING.value and worker == worker_id
    }
    newest = max(running.values(), default=None)
    blamed = frozenset(r for r, stepped in running.items() if stepped == newest)
    return Death(blamed=blamed, witnesses=frozenset(running))
