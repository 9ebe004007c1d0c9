"""One blocking XREAD for every chunk stream this producer follows.

A follower per client used to block on its own XREAD: at 40 streams and a
worker step every 12 ms, that is 40 replies, 40 wake-ups and 40 new reads
per step, and it was nearly half of the producer's time (py-spy, issue 7).
The hub instead keeps one connection blocked on one XREAD over all the
followed streams, each from the newest entry it has seen; whatever arrives
goes into that stream's buffer and wakes its reader. Streams join when a
follower first reads and leave when it is done.

A stream that joins while the XREAD is blocked would wait for the block to
end; the hub ends it at once with ``CLIENT UNBLOCK`` (the blocked read
returns empty, as on a timeout, and the next one includes the new stream).
Redis outages are ridden out with backoff; readers meanwhile see quiet
streams and check the status hash as before (``streaming.ChunkFollower``).

Every chunk a client of this producer receives passes through here first,
so the hub is where client-side latency is observed (``latency``: joins,
arrivals with one clock reading per XREAD reply, leaves).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from producer import store
from producer.monitoring.client_latency import ClientLatency
from producer.redis_client import OUTAGE_ERRORS
from shared import codec
from shared.keys import Keys
from shared.schemas import TokenChunk

log = logging.getLogger(__name__)

UNBLOCK_TRIES = 3  # the XREAD may not have reached Redis yet when a stream joins
CLOSE_WAIT_S = 2.0


@dataclass
class _Stream:
    cursor: str  # newest entry read into ``buffer`` (or the reader's start)
    waiter: asyncio.Event  # set when ``buffer`` gets entries; shared by one reader's streams
    buffer: list[store.StreamEntry] = field(default_factory=list)


class StreamHub:
    def __init__(self, redis: aioredis.Redis, keys: Keys, block_ms: int, latency: ClientLatency | None = None):
        self.redis, self.keys, self.block_ms = redis, keys, block_ms
        self.latency = latency  # None: nothing observed (a hub outside the app)
        self._streams: dict[str, _Stream] = {}  # request id -> its stream's state
        self._joined = asyncio.Event()  # a stream joined since the XREAD was sent
        self._blocked_id: int | None = None  # client id of the hub's connection while its XREAD blocks
        self._task: asyncio.Task | None = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_WAIT_S)

    async def read_many(self, after: dict[str, str], block_ms: int | None) -> list[tuple[str, str, TokenChunk]]:
        """``store.read_many_after`` through the hub: (request id, entry id, chunk) after each
        request's ``after[id]``, waiting up to ``block_ms`` for the first. Streams stay joined
        (``leave`` them when done)."""
        if self._task is None:  # started by the first reader, in the loop that serves requests
            self._task = asyncio.create_task(self._run(), name="stream-hub")
        waiter = asyncio.Event()
        for request_id, last in after.items():
            stream = self._streams.get(request_id)
            if stream is None:
                self._streams[request_id] = _Stream(last, waiter)
                if self.latency is not None:
                    self.latency.join(request_id, last)
                self._joined.set()
                await self._unblock()
            else:
                stream.waiter = waiter
                if stream.buffer:
                    waiter.set()
        if not waiter.is_set() and block_ms:
            try:
                await asyncio.wait_for(waiter.wait(), block_ms / 1000)
            except asyncio.TimeoutError:
                pass
        return [(request_id, entry_id, chunk) for request_id in after for entry_id, chunk in self._take(request_id)]

    def leave(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None and self.latency is not None:
                self.latency.leave(request_id)

    def _take(self, request_id: str) -> list[store.StreamEntry]:
        """What arrived after the reader's start or its last take (readers drop repeats anyway)."""
        stream = self._streams.get(request_id)
        if stream is None or not stream.buffer:
            return []
        entries, stream.buffer = stream.buffer, []
        return entries

    async def _unblock(self) -> None:
        for _ in range(UNBLOCK_TRIES):
            client_id = self._blocked_id
            if client_id is None or await self.redis.client_unblock(client_id):
                return
            await asyncio.sleep(0.001)  # sent but not yet blocked in Redis: try again

    async def _run(self) -> None:
        delay = 0.05
        while True:
            conn = self.redis.client()  # one connection for the hub's reads, and its id to unblock
            try:
                client_id = await conn.client_id()
                while True:
                    await self._read_once(conn, client_id)
                    delay = 0.05
            except OUTAGE_ERRORS as exc:
                log.warning("stream hub: Redis unreachable (%s): retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                self._blocked_id = None
                await conn.aclose()

    async def _read_once(self, conn: aioredis.Redis, client_id: int) -> None:
        if not self._streams:
            self._joined.clear()
            await self._joined.wait()
        self._joined.clear()
        names = {self.keys.chunks(request_id): request_id for request_id in self._streams}
        streams = {key: self._streams[request_id].cursor for key, request_id in names.items()}
        self._blocked_id = client_id
        try:
            reply = await conn.xread(streams, block=self.block_ms)
        finally:
            self._blocked_id = None
        now = time.monotonic()
        for key, entries in reply or []:
            stream = self._streams.get(names[key])
            if stream is None or not entries:  # None: its reader left meanwhile
                continue
            stream.cursor = entries[-1][0]
            chunks = self._parse(key, entries)
            if self.latency is not None:
                self.latency.arrived(names[key], chunks, now)
            stream.buffer += chunks
            if stream.buffer:
                stream.waiter.set()

    @staticmethod
    def _parse(key: str, entries: list) -> list[store.StreamEntry]:
        # pydantic per chunk stays: with 64 streams through one producer, decoding was ~1% of its
        # samples (py-spy), HTTP and SSE serving most of the rest (measured for issue 13, item 4).
        chunks = []
        for entry_id, fields in entries:
            try:
                chunks.append((entry_id, codec.from_entry(TokenChunk, fields)))
            except ValueError as exc:  # skipped: a request left without its end ends from its status hash
                log.error("stream hub: unreadable entry %s in %s: %s", entry_id, key, exc)
        return chunks
