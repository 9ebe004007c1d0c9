"""Prometheus metrics of one producer app (a registry per app, no globals).

Counters are updated by the routes; queue and worker gauges are read from
Redis at scrape time, so every producer replica reports the same cluster view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from redis.exceptions import ResponseError

from shared.keys import ROUTER_GROUP, WORKER_GROUP, Keys
from shared.schemas import WorkerLoad

WORKER_FIELDS = {
    "used_tokens": "lightq:worker_used_tokens",
    "max_total_tokens": "lightq:worker_max_total_tokens",
    "num_running": "lightq:worker_running_requests",
    "num_waiting": "lightq:worker_waiting_requests",
}


class ProducerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.accepted = Counter("lightq:requests_accepted", "requests enqueued", ["route"], registry=reg)
        self.rejected = Counter("lightq:requests_rejected", "requests refused before enqueue", ["reason"],
                                registry=reg)
        self.prompt_tokens = Counter("lightq:prompt_tokens", "prompt tokens of accepted requests", registry=reg)
        self.disconnects = Counter("lightq:client_disconnects", "requests cancelled because the client left",
                                   registry=reg)
        self.ingress_depth = Gauge("lightq:ingress_queue_depth", "requests not yet routed (lag + pending)",
                                   registry=reg)
        self.inbox_depth = Gauge("lightq:worker_inbox_depth", "dispatched, not finished (lag + pending)",
                                 ["worker"], registry=reg)
        self.worker_gauges = {
            name: Gauge(metric, f"WorkerLoad.{name} from the worker's heartbeat", ["worker"], registry=reg)
            for name, metric in WORKER_FIELDS.items()
        }

    async def render(self, redis: aioredis.Redis, keys: Keys) -> bytes:
        snapshot = await read_snapshot(redis, keys)
        self._apply(snapshot)
        return generate_latest(self.registry)

    def _apply(self, snapshot: "Snapshot") -> None:
        # One synchronous block: concurrent scrapes never see half-cleared labels.
        self.ingress_depth.set(snapshot.ingress_depth)
        self.inbox_depth.clear()
        for gauge in self.worker_gauges.values():
            gauge.clear()
        for load in snapshot.loads:
            self.inbox_depth.labels(worker=load.worker_id).set(snapshot.inbox_depths[load.worker_id])
            for name, gauge in self.worker_gauges.items():
                gauge.labels(worker=load.worker_id).set(getattr(load, name))


@dataclass
class Snapshot:
    ingress_depth: int = 0
    loads: list[WorkerLoad] = field(default_factory=list)
    inbox_depths: dict[str, int] = field(default_factory=dict)


async def read_snapshot(redis: aioredis.Redis, keys: Keys) -> Snapshot:
    snapshot = Snapshot(ingress_depth=await group_backlog(redis, keys.requests(), ROUTER_GROUP))
    snapshot.loads = await live_workers(redis, keys)
    for load in snapshot.loads:
        snapshot.inbox_depths[load.worker_id] = await group_backlog(redis, keys.inbox(load.worker_id), WORKER_GROUP)
    return snapshot


async def live_workers(redis: aioredis.Redis, keys: Keys) -> list[WorkerLoad]:
    """Registered workers whose heartbeat (load key with TTL) still exists."""
    worker_ids = await redis.zrange(keys.workers(), 0, -1)
    if not worker_ids:
        return []
    pipe = redis.pipeline(transaction=False)  # load keys live in different slots
    for worker_id in worker_ids:
        pipe.get(keys.load(worker_id))
    raw_loads = await pipe.execute()
    loads = []
    for raw in raw_loads:
        if raw is not None:
            try:
                loads.append(WorkerLoad.model_validate_json(raw))
            except ValueError:
                continue  # a heartbeat from an incompatible worker: not ours to show
    return loads


async def group_backlog(redis: aioredis.Redis, stream: str, group: str) -> int:
    """Entries the group has not finished: lag (undelivered) + pending (unacked).

    Without the group every entry is undelivered; without the stream there is none.
    """
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such key
        return 0
    info = next((g for g in groups if g["name"] == group), None)
    if info is None:
        return int(await redis.xlen(stream))
    lag = info.get("lag")
    if lag is None:  # Redis cannot tell after deletions: count what follows the last delivery
        lag = len(await redis.xrange(stream, min=f"({info['last-delivered-id']}", count=100_000))
    return int(lag) + int(info["pending"])
