"""The pool as Redis shows it: the queue, the workers, recent requests, throughput.

Read by the producer's refresh task (every ``--metrics_refresh_s``, off the
request path; ``/metrics`` and ``/dashboard/data`` serve the last read) and
by ``lightq top``. Everything comes from records the services already write,
so every producer replica and every terminal computes the same numbers:

| number                  | from                                                           |
|-------------------------|----------------------------------------------------------------|
| ingress lag / pending   | XINFO GROUPS of ``{q}:requests`` (group ``routers``)            |
| queued tokens           | the queued entries: prompt + estimated output (see below)       |
| per-worker load         | the heartbeat records ``{q}:w:ID:load``                        |
| inbox lag / pending     | XINFO GROUPS of ``{q}:w:ID:inbox`` (group ``worker``)           |
| prefix cache per worker | the heartbeat records: cached tokens, hits / tokens asked, evicted |
| routing decisions       | ``{q}:router_decisions``: every router's, by reason             |
| recent requests         | ingress entries as they arrive (``RequestTracker``), then their status hashes |
| throughput, drain rate  | recent requests finished / dispatched in the last ``window_s`` |
| backlog GPU-seconds     | queued tokens / throughput (both prompt + output tokens)       |

A queued request's estimated output is the mean of ``outlen`` capped by its max_new_tokens
(exactly max_new_tokens with ignore_eos).

The ingress entry's id is Redis's clock at enqueue, as are chunk entry ids,
so latencies measured between them need no clock agreement between hosts.
Times in the status hashes (``*_ms``) are the writers' clocks (NTP assumed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer.edge.backlog import estimated_output
from producer.edge.pool_fit import live_workers
from producer.monitoring.recent import WINDOW_S, RecentRequest, RequestTracker
from shared import ingress
from shared.codec import from_entry
from shared.keys import ROUTER_GROUP, WORKER_GROUP, Keys, split_class_tenant_field
from shared.schemas import GenerateRequest, RequestStatus
from shared.worker_load import WorkerLoad

QUEUE_SCAN_MAX = 10_000  # queued entries whose tokens are counted
HISTORY_LEN = 200  # output lengths the estimate averages
MIN_THROUGHPUT = 1.0  # tokens/s assumed when nothing finished lately: a backlog with no drain stays large


@dataclass(frozen=True)
class Backlog:
    """A consumer group's unfinished entries: lag (never delivered) and pending (delivered, unacked)."""

    lag: int = 0
    pending: int = 0

    @property
    def total(self) -> int:
        return self.lag + self.pending


@dataclass
class ClusterSnapshot:
    ts_ms: int
    ingress: Backlog = field(default_factory=Backlog)
    queue_prompt_tokens: int = 0
    queue_output_tokens: int = 0  # estimated
    loads: list[WorkerLoad] = field(default_factory=list)
    inboxes: dict[str, Backlog] = field(default_factory=dict)
    dead_letters: int = 0
    # router.order.ordering's counters: (priority, tenant) -> requests queued, tokens dispatched
    tenant_queued: dict[tuple[int, str], int] = field(default_factory=dict)
    tenant_served: dict[tuple[int, str], int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # reason -> decisions (router.admission.choice.Reason)
    recent: list[RecentRequest] = field(default_factory=list)
    window_s: float = WINDOW_S

    @property
    def queue_tokens(self) -> int:
        return self.queue_prompt_tokens + self.queue_output_tokens

    def _since(self) -> int:
        return self.ts_ms - int(self.window_s * 1000)

    def finished_in_window(self) -> list[RecentRequest]:
        return [
            r
            for r in self.recent
            if r.status == RequestStatus.FINISHED.value and r.finished_ms is not None and r.finished_ms >= self._since()
        ]

    @property
    def throughput_tokens_per_s(self) -> float:
        """Prompt + output tokens of the requests finished in the window, per second."""
        return sum(r.prompt_tokens + r.output_tokens for r in self.finished_in_window()) / self.window_s

    @property
    def generation_tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.finished_in_window()) / self.window_s

    @property
    def drain_rate(self) -> float:
        """Requests that left the ingress queue (dispatched) per second over the window."""
        since = self._since()
        return sum(1 for r in self.recent if r.dispatched_ms is not None and r.dispatched_ms >= since) / self.window_s

    @property
    def arrival_rate(self) -> float:
        since = self._since()
        return sum(1 for r in self.recent if r.enqueued_ms >= since) / self.window_s

    @property
    def backlog_gpu_seconds(self) -> float:
        """Seconds the pool needs to drain the queue at its recent throughput: the autoscaling signal."""
        return self.queue_tokens / max(self.throughput_tokens_per_s, MIN_THROUGHPUT)

    def workers_by_model(self, own: str) -> dict[str, int]:
        """Live workers per served model name (``/v1/models``); a worker without a name takes any
        request, so it counts for ``own``, the model of the producer asking."""
        counts: dict[str, int] = {}
        for load in self.loads:
            counts[load.model or own] = counts.get(load.model or own, 0) + 1
        return counts

    def worker_summary(self) -> list[dict]:
        return [
            {
                "worker": load.worker_id,
                "running": load.num_running,
                "waiting": load.num_waiting,
                "used_tokens": load.used_tokens,
                "cached_tokens": load.cached_tokens,  # the prefix cache (worker.engine.radix_cache)
                "prefix_hit_ratio": prefix_hit_ratio(load),
                "prefix_evicted_tokens": load.prefix_evicted_tokens,
                "preempted_requests": load.preempted_requests,  # router --preempt (worker.engine.preempt)
                "preempted_kv_tokens": load.preempted_kv_tokens,
                "committed_tokens": load.committed_tokens,
                "max_total_tokens": load.max_total_tokens,
                "kv_usage": kv_usage(load),
                "inbox": self.inboxes.get(load.worker_id, Backlog()).total,
                "draining": load.draining,
            }
            for load in sorted(self.loads, key=lambda item: item.worker_id)
        ]


def kv_usage(load: WorkerLoad) -> float:
    return load.used_tokens / load.max_total_tokens if load.max_total_tokens else 0.0


def prefix_hit_ratio(load: WorkerLoad) -> float:
    """Prompt tokens served from the worker's prefix cache / tokens it looked up, since it started."""
    return load.prefix_hit_tokens / load.prefix_asked_tokens if load.prefix_asked_tokens else 0.0


async def read_cluster(
    redis: aioredis.Redis, keys: Keys, tracker: RequestTracker | None = None, window_s: float = WINDOW_S
) -> ClusterSnapshot:
    """One snapshot; pass the same ``tracker`` every time to remember trimmed requests."""
    snap = ClusterSnapshot(ts_ms=int(time.time() * 1000), window_s=window_s)
    snap.ingress, queued = await queued_requests(redis, keys, tracker.parsed if tracker else None)
    mean_len = await mean_output_length(redis, keys)
    snap.queue_prompt_tokens = sum(r.num_prompt_tokens for r in queued)
    snap.queue_output_tokens = sum(estimated_output(r, mean_len) for r in queued)
    snap.loads = await live_workers(redis, keys)
    for load in snap.loads:
        snap.inboxes[load.worker_id] = await group_backlog(redis, keys.inbox(load.worker_id), WORKER_GROUP)
    snap.dead_letters = int(await redis.xlen(keys.dead_letters()))
    snap.tenant_queued = _by_class_tenant(await redis.hgetall(keys.tenant_queued()))
    snap.tenant_served = _by_class_tenant(await redis.hgetall(keys.tenant_served()))
    snap.decisions = {reason: int(n) for reason, n in (await redis.hgetall(keys.router_decisions())).items()}
    snap.recent = await (tracker or RequestTracker(window_s)).refresh(redis, keys, snap.ts_ms)
    return snap


def _by_class_tenant(fields: dict) -> dict[tuple[int, str], int]:
    return {split_class_tenant_field(k): int(v) for k, v in fields.items()}


async def _group_info(redis: aioredis.Redis, stream: str, group: str) -> dict | None:
    """The group's XINFO entry; {} when the stream exists without it; None without the stream."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such key
        return None
    return next((g for g in groups if g["name"] == group), {})


async def group_backlog(redis: aioredis.Redis, stream: str, group: str) -> Backlog:
    """Without the group every entry is lag; without the stream there is none."""
    info = await _group_info(redis, stream, group)
    if info is None:
        return Backlog()
    if not info:
        return Backlog(lag=int(await redis.xlen(stream)))
    lag = info.get("lag")
    if lag is None:  # Redis cannot tell after deletions: count what follows the last delivery
        lag = len(await redis.xrange(stream, min=f"({info['last-delivered-id']}", count=100_000))
    return Backlog(lag=int(lag), pending=int(info["pending"]))


async def queued_requests(
    redis: aioredis.Redis,
    keys: Keys,
    parsed: dict[str, GenerateRequest] | None = None,
) -> tuple[Backlog, list[GenerateRequest]]:
    """The ingress backlog and the requests in it (the first ``QUEUE_SCAN_MAX`` of each kind).

    ``parsed``: the entries a previous call parsed, by entry id, kept up to date here. An entry
    never changes, and at the peak of a burst fetching and parsing thousands of them again every
    second was most of a read's CPU (``bench.serving.scrape_latency``); with it, a read fetches the
    entries that arrived since the last one (and pending ones it has not seen). Every class's
    stream (``shared.ingress``) counts; ``parsed`` names entries by ``ingress.handle``."""
    known: dict[str, dict[str, GenerateRequest]] = {}  # stream -> entry id -> request, parsed before
    for handle, request in (parsed or {}).items():
        stream, entry_id = ingress.locate(keys, handle)
        known.setdefault(stream, {})[entry_id] = request
    backlog, current = Backlog(), {}
    for priority, stream in await ingress.streams_async(redis, keys):
        lagging, found = await _queued_in(redis, stream, known.get(stream, {}))
        backlog = Backlog(lag=backlog.lag + lagging.lag, pending=backlog.pending + lagging.pending)
        current.update((ingress.handle(priority, i), r) for i, r in found.items())
    if parsed is not None:  # only what is still queued: the cache never outgrows the queue
        parsed.clear()
        parsed.update(current)
    return backlog, list(current.values())


async def _queued_in(
    redis: aioredis.Redis, stream: str, known: dict[str, GenerateRequest]
) -> tuple[Backlog, dict[str, GenerateRequest]]:
    """One class's stream: its backlog and queued requests by entry id (``known``: parsed before)."""
    backlog = await group_backlog(redis, stream, ROUTER_GROUP)
    entries: list[tuple[str, dict]] = []
    if backlog.lag:  # never delivered: the entries after the group's last delivery
        info = await _group_info(redis, stream, ROUTER_GROUP)
        delivered = _entry_key(info["last-delivered-id"]) if info else (0, -1)
        still = sorted((i for i in known if _entry_key(i) > delivered), key=_entry_key)
        start = still[-1] if still else (info["last-delivered-id"] if info else None)
        entries = [(entry_id, {}) for entry_id in still]  # parsed before: only newer ones are fetched
        entries += await redis.xrange(stream, min=f"({start}" if start else "-", count=QUEUE_SCAN_MAX)
    if backlog.pending:
        pending = await redis.xpending_range(stream, ROUTER_GROUP, min="-", max="+", count=QUEUE_SCAN_MAX)
        ids = [item["message_id"] for item in pending]
        pipe = redis.pipeline(transaction=False)
        for entry_id in ids:
            if entry_id not in known:  # only entries not parsed before are fetched
                pipe.xrange(stream, min=entry_id, max=entry_id)
        fetched = dict(e for found in await pipe.execute() for e in found)
        entries += [(entry_id, fetched.get(entry_id, {})) for entry_id in ids]
    current: dict[str, GenerateRequest] = {}
    for entry_id, fields in entries:
        request = known.get(entry_id)
        if request is None:
            try:
                request = from_entry(GenerateRequest, fields)
            except ValueError:
                continue  # unreadable (the router dead-letters it), or deleted meanwhile
        current[entry_id] = request
    return backlog, current


def _entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as Redis orders them: (milliseconds, sequence)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


async def mean_output_length(redis: aioredis.Redis, keys: Keys) -> float | None:
    lengths = [int(x) for x in await redis.lrange(keys.output_lengths(), 0, HISTORY_LEN - 1)]
    return sum(lengths) / len(lengths) if lengths else None
