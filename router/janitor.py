"""Re-dispatch what a dead worker held.

A worker whose load record expired is dead. Every request still in its
inbox that has not ended goes back onto the ingress stream with the tokens
it already emitted (``shared.requeue``); one whose workers died
``max_attempts`` times goes to the dead-letter stream and ends ``failed``,
so a poison request cannot take the whole pool down. A lock key makes sure
only one router reaps a given worker.
"""

from __future__ import annotations

import logging

import redis

from shared.keys import Keys
from shared.requeue import hand_back_inbox

log = logging.getLogger("lightq.router")


def reap_dead_worker(client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, max_attempts: int = 3) -> int:
    """Requeue a dead worker's unfinished requests; returns how many went back."""
    if not client.set(keys.reap_lock(worker_id), "1", nx=True, ex=60):
        return 0
    requeued = hand_back_inbox(client, keys, worker_id, ttl_s, max_attempts, count_attempt=True)
    pipe = client.pipeline(transaction=True)
    pipe.delete(keys.inbox(worker_id))
    pipe.zrem(keys.workers(), worker_id)
    pipe.execute()
    if requeued:
        log.warning("worker %s is gone: %d requests dispatched again", worker_id, requeued)
    return requeued
