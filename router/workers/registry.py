"""The set of live workers, read from their heartbeats.

A worker is live while its load record (a key with a TTL of a few heartbeat
periods) exists. A member of the workers set whose record has expired is
dead: the janitor re-dispatches whatever its inbox still holds. A live
record older than ``stale_ms`` (its ``ts_ms`` against this host's clock,
so hosts are assumed NTP-synchronised) belongs to a worker that stopped
reporting progress: it counts as full, never as free room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from shared.codec import decode
from shared.keys import Keys
from shared.request_log import now_ms
from shared.worker_load import WorkerLoad


@dataclass(frozen=True)
class Registry:
    live: dict[str, WorkerLoad]
    dead: list[str]
    stale: frozenset[str] = field(default_factory=frozenset)

    def admissible(self) -> dict[str, WorkerLoad]:
        """Live workers whose record is fresh enough to admit against."""
        return {w: load for w, load in self.live.items() if w not in self.stale}


def read_registry(client: redis.Redis, keys: Keys, stale_ms: int | None = None) -> Registry:
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
    now = now_ms()
    stale = frozenset(w for w, load in live.items() if stale_ms is not None and now - load.ts_ms > stale_ms)
    return Registry(live=live, dead=dead, stale=stale)
