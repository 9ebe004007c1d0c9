"""The set of live workers, read from their heartbeats.

A worker is live while its load record (a key with a TTL of a few heartbeat
periods) exists. A member of the workers set whose record has expired is
dead: the janitor re-dispatches whatever its inbox still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shared.codec import decode
from shared.keys import Keys
from shared.schemas import WorkerLoad


@dataclass(frozen=True)
class Registry:
    live: dict[str, WorkerLoad]
    dead: list[str]


def read_registry(client: redis.Redis, keys: Keys) -> Registry:
    members = client.zrange(keys.workers(), 0, -1)
    if not members:
        return Registry(live={}, dead=[])
    records = client.mget([keys.load(worker_id) for worker_id in members])
    live: dict[str, WorkerLoad] = {}
    dead: list[str] = []
    for worker_id, record in zip(members, records):
        if record is None:
            dead.append(worker_id)
        else:
            live[worker_id] = decode(WorkerLoad, record)
    return Registry(live=live, dead=dead)
