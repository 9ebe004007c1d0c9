"""Recent requests, as the cluster view follows them: seen on the ingress stream, then read
from their status hashes until they end (an ended one is kept as last read) and a window after
(``producer.monitoring.cluster`` counts throughput and latencies over them; the dashboard lists
them).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from shared import ingress
from shared.codec import from_entry
from shared.keys import Keys
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus

WINDOW_S = 60.0
RECENT_MAX = 2000  # ingress entries scanned for recent requests (bounds a scrape's cost)


class _IngressId(BaseModel):
    """An ingress entry's request id alone: the view reads it through the codec without
    building the whole ``GenerateRequest`` (its prompt ids are most of the entry)."""

    model_config = ConfigDict(extra="ignore")
    id: str


@dataclass(frozen=True)
class RecentRequest:
    id: str
    enqueued_ms: int  # Redis's clock at the first ingress entry
    status: str
    prompt_tokens: int
    max_new_tokens: int
    output_tokens: int
    worker: str | None
    created_ms: int
    dispatched_ms: int | None
    started_ms: int | None
    finished_ms: int | None

    @property
    def is_terminal(self) -> bool:
        return RequestStatus(self.status).is_terminal


class RequestTracker:
    """Requests seen on the ingress stream, followed until they end and ``keep_s`` after.

    Housekeeping trims dispatched entries off the ingress stream, so a reader
    that refreshes more often than it trims (a minute) remembers every
    request from the first time it sees its entry. A fresh tracker (``lightq
    top --once``) knows only the entries still in the stream.
    """

    def __init__(self, keep_s: float = WINDOW_S, limit: int = RECENT_MAX):
        self.keep_s = keep_s
        self.limit = limit
        self.last_ids: dict[str, str] = {}  # per class's stream: the last entry read
        self.enqueued: dict[str, int] = {}  # request id -> Redis ms of its first entry, oldest first
        self.parsed: dict[str, GenerateRequest] = {}  # queued ingress entries already parsed, by entry id
        # Ended requests as last read: a terminal status never changes, so it is not read again
        # (a refresh reads only live requests' hashes). A new ingress entry of one (an operator's
        # dead-letter requeue, the one way back) forgets it.
        self.ended: dict[str, RecentRequest] = {}

    async def _read_new(self, redis: aioredis.Redis, keys: Keys) -> None:
        """New entries of every class's stream (``shared.ingress``), each read on from where it was."""
        streams = await ingress.streams_async(redis, keys)
        for _, stream in streams:
            last = self.last_ids.get(stream)
            if last is None:
                entries = list(reversed(await redis.xrevrange(stream, count=self.limit)))
            else:
                entries = await redis.xrange(stream, min=f"({last}", count=10 * self.limit)
            for entry_id, fields in entries:
                try:
                    request_id = from_entry(_IngressId, fields).id
                except ValueError:  # pydantic's ValidationError is one: an entry not ours, skipped
                    request_id = None
                if request_id is not None:
                    self.enqueued.setdefault(request_id, int(entry_id.partition("-")[0]))
                    self.ended.pop(request_id, None)
                self.last_ids[stream] = entry_id
        if len(streams) > 1:  # oldest first across the classes' streams (one stream: already)
            self.enqueued = dict(sorted(self.enqueued.items(), key=lambda item: item[1]))

    async def refresh(self, redis: aioredis.Redis, keys: Keys, now_ms: int) -> list[RecentRequest]:
        """Every tracked request with its status now, newest first."""
        await self._read_new(redis, keys)
        live = [request_id for request_id in self.enqueued if request_id not in self.ended]
        pipe = redis.pipeline(transaction=False)
        for request_id in live:
            pipe.hgetall(keys.meta(request_id))
        read = dict(zip(live, await pipe.execute()))
        out = []
        for request_id, enqueued_ms in list(self.enqueued.items()):
            data = read.get(request_id)
            request = self.ended.get(request_id) or (
                _recent(request_id, enqueued_ms, data) if data and "status" in data else None  # else gone
            )
            if request is None or (request.is_terminal and (request.finished_ms or 0) < now_ms - self.keep_s * 1000):
                del self.enqueued[request_id]  # expired, or ended long enough ago
                self.ended.pop(request_id, None)
                continue
            if request.is_terminal:
                self.ended[request_id] = request
            out.append(request)
        for request_id in list(self.enqueued)[: max(0, len(self.enqueued) - self.limit)]:
            del self.enqueued[request_id]  # over the limit: forget the oldest
            self.ended.pop(request_id, None)
        return out[::-1][: self.limit]


def _recent(request_id: str, enqueued_ms: int, data: dict) -> RecentRequest:
    meta = RequestMeta.from_hash(data)
    return RecentRequest(
        id=request_id,
        enqueued_ms=enqueued_ms,
        status=meta.status.value,
        prompt_tokens=meta.prompt_tokens,
        max_new_tokens=meta.max_new_tokens,
        output_tokens=meta.output_tokens,
        worker=meta.worker,
        created_ms=meta.created_ms,
        dispatched_ms=meta.dispatched_ms,
        started_ms=meta.started_ms,
        finished_ms=meta.finished_ms,
    )
