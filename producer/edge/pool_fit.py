"""The door's check that a request fits some live worker at all.

A request waits at the head of its class's queue until a worker has room for it (the router's
admission check). One that no worker could hold even with nothing else running (its samples'
KV tokens over every pool, or more samples than a worker runs at once) would wait there for
ever, and every request of its class and worse classes with it: one client's ``n`` = 8 with a
large ``max_tokens`` stopped the pool. So the producer refuses it with a 400 before it writes
anything: its most KV tokens (``GenerateRequest.max_tokens_needed``: the prompt once, each
sample's ``max_new_tokens``) must fit the pool of a live worker that serves its model (and
adapter), less the share its admission policy keeps free (``shared.worker_load.admits``), and
its samples that worker's ``running_max_req_size``.

While no such worker is live nothing is refused here (one may be starting, or all are being
replaced); the router ends a request that still fits none once some are (``router.loop``).
The live workers' records are read at most every ``REFRESH_S`` per producer.
"""

from __future__ import annotations

import math
import sys
import time

import redis.asyncio as aioredis

from producer.api.errors import bad_request
from shared.keys import Keys
from shared.schemas import GenerateRequest
from shared.worker_load import TOO_LARGE, WorkerLoad, admits, misfit

REFRESH_S = 2.0  # the workers' records, for the fit
LIVE_REFRESH_S = 0.5  # whether any worker is live, for the no-worker 503


async def live_workers(redis: aioredis.Redis, keys: Keys) -> list[WorkerLoad]:
    """Registered workers whose heartbeat (load key with TTL) still exists, those whose record this
    version reads."""
    worker_ids = await redis.zrange(keys.workers(), 0, -1)
    if not worker_ids:
        return []
    pipe = redis.pipeline(transaction=False)  # load keys live in different slots
    for worker_id in worker_ids:
        pipe.get(keys.load(worker_id))
    loads = []
    for raw in await pipe.execute():
        if raw is not None:
            try:
                loads.append(WorkerLoad.model_validate_json(raw))
            except ValueError:
                continue  # a heartbeat from an incompatible worker: not ours to read
    return loads


class PoolFit:
    """``check`` a request against the live workers' records, read at most every ``REFRESH_S`` (what
    it reads, each worker's capacity, changes only when workers come and go; a record is KBs, so a
    producer reads them every few seconds, not per request), and ``any_live``, a cheaper look at
    the heartbeats alone every ``LIVE_REFRESH_S`` (the no-worker 503)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis, self.keys = redis, keys
        self.loads: list[WorkerLoad] = []
        self._read_at = -math.inf
        self._live = False
        self._live_at = -math.inf

    async def refresh(self) -> list[WorkerLoad]:
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self.loads = await live_workers(self.redis, self.keys)
            self._read_at = now
        return self.loads

    async def largest(self, model: str | None, adapter: str | None = None) -> int:
        """The KV tokens admission lets one request need on the largest live pool that takes
        ``model`` (and ``adapter``; ``admits``): what a prompt and its ``n`` answers may fill without
        a ``max_tokens`` (no bound while none is known)."""
        loads = [load for load in await self.refresh() if load.takes(model, adapter)]
        return max((admits(load) for load in loads), default=sys.maxsize)

    async def any_live(self) -> bool:
        """Whether any worker has a heartbeat (a record this version cannot read counts too)."""
        now = time.monotonic()
        if now - self._live_at >= LIVE_REFRESH_S:
            self._live = await self._any_heartbeat()
            self._live_at = now
        return self._live

    async def _any_heartbeat(self) -> bool:
        members = await self.redis.zrange(self.keys.workers(), 0, -1)
        if not members:
            return False
        pipe = self.redis.pipeline(transaction=False)  # load keys live in different slots
        for worker_id in members:
            pipe.exists(self.keys.load(worker_id))
        return any(await pipe.execute())

    async def check(self, request: GenerateRequest) -> None:
        """400 ``request_too_large`` when no live worker serving it could ever take it."""
        why = misfit(request, await self.refresh())
        if why is not None:
            param = "n" if request.n > 1 else "max_tokens"
            raise bad_request(why, param=param, code=TOO_LARGE, reason="too_long")
