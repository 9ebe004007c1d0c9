"""One reader of Redis for every chunk stream this producer follows.

A follower per client used to block on its own XREAD: at 40 streams and a
worker step every 12 ms, that is 40 replies, 40 wake-ups and 40 new reads
per step, and it was nearly half of the producer's time (py-spy, issue 7).
The hub keeps one connection blocked for all of them. It used to block on
one XREAD over every followed stream: each wake-up cost Redis and the
producer a pass over all of them (a 512-stream XREAD was ~380 us of Redis
CPU), however few had news.

Now workers say which streams have news. Each request carries its
producer's wake stream (``GenerateRequest.reply_to``, ``Keys.wake``), and a
publisher's flush appends there the ids of the requests it wrote
(``worker.service.chunk_writer``). The hub blocks on its wake stream (and on
the streams of requests submitted elsewhere, which get no wakes: a resume
through ``/v1/requests/{id}/stream``), then reads just the streams woken,
from each one's cursor. A stream that joins is read at once (its first
runs may precede its wakes); one whose reader waited ``block_ms`` in vain
is read again directly (a lost wake costs a wait, never a hang).

A stream that joins while the read is blocked would wait for the block to
end; the hub ends it at once with ``CLIENT UNBLOCK`` (the blocked read
returns empty, as on a timeout, and the next one includes the new stream).
Redis outages are ridden out with backoff; readers meanwhile see quiet
streams and check the status hash as before (``streaming.ChunkFollower``).

On a Redis Cluster one XREAD cannot span slots: the hub reads the streams
woken (and the foreign ones) without blocking, one XREAD per request group
in one pipeline (``shared.redis.xread_spread``), and blocks on its wake
stream alone, on a connection of its own to that stream's node; with
foreign streams followed, that block lasts ``FOREIGN_POLL_MS`` at most.

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
from shared.chunk_schemas import ChunkRun
from shared.chunks import parse_run
from shared.keys import Keys
from shared.redis import client_is_cluster, node_client, xread_spread

log = logging.getLogger(__name__)

UNBLOCK_TRIES = 3  # the XREAD may not have reached Redis yet when a stream joins
CLOSE_WAIT_S = 2.0
WAKE_TTL_S = 120  # a producer that is gone leaves no wake stream behind for long
WAKE_REFRESH_S = 30.0
RECHECK_WAIT_S = 0.05  # a direct read after a quiet wait takes a round trip
FOREIGN_POLL_MS = 50  # on a cluster: how often streams without wakes are read
WAKE_MAXLEN = 10_000  # wakes a hub may fall behind by before the oldest go (its readers then wait block_ms)


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    """``event``, or the timeout. A timer, not asyncio.wait_for: that makes a task per wait, and a
    producer waits thousands of times a second under a burst."""
    timer = asyncio.get_running_loop().call_later(timeout_s, event.set)
    try:
        await event.wait()
    finally:
        timer.cancel()


def hub_name(keys: Keys) -> str:
    """The hub connection's client name (no spaces: a key prefix has none)."""
    return f"lightq-stream-hub:{keys.prefix}"


@dataclass
class _Stream:
    cursor: str  # newest entry read into ``buffer`` (or the reader's start)
    waiter: asyncio.Event  # set when ``buffer`` gets entries; shared by one reader's streams
    buffer: list[store.StreamEntry] = field(default_factory=list)
    # The reader wants its entries only at an end (a whole answer: /generate, a completion): runs
    # that end nothing wait in the buffer, and the reader is not woken for each of them.
    ends_only: bool = False
    woken: bool = True  # read it directly in the next read (it just joined, or a wake named it)
    own: bool = False  # its writer wakes this hub (it was submitted here); else it is in the blocking read


class StreamHub:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        block_ms: int,
        latency: ClientLatency | None = None,
        wake_id: str | None = None,
    ):
        self.redis, self.keys, self.block_ms = redis, keys, block_ms
        self.latency = latency  # None: nothing observed (a hub outside the app)
        # The requests this producer submits name it (GenerateRequest.reply_to); None: no wakes,
        # every stream is in the blocking read.
        self.wake_id = wake_id
        self._wake_cursor = "$"
        self._wake_refresh = 0.0
        self._streams: dict[str, _Stream] = {}  # request id -> its stream's state
        self._joined = asyncio.Event()  # a stream joined (or wants a direct read) since the XREAD was sent
        self._blocked_id: int | None = None  # client id of the hub's connection while its XREAD blocks
        self._unblocker: aioredis.Redis = redis  # a client of the blocked connection's server
        self.cluster = client_is_cluster(redis)
        self._task: asyncio.Task | None = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=CLOSE_WAIT_S)

    async def read_many(
        self, after: dict[str, str], block_ms: int | None, ends_only: bool = False, own: bool = False
    ) -> list[tuple[str, str, ChunkRun]]:
        """``store.read_many_after`` through the hub: (request id, entry id, run) after each
        request's ``after[id]``, waiting up to ``block_ms`` for the first (with ``ends_only``, for
        a run that ends a sample; then everything buffered comes). ``own``: the requests were
        submitted here (their writers wake this hub). Streams stay joined (``leave`` them when done)."""
        if self._task is None:  # started by the first reader, in the loop that serves requests
            self._task = asyncio.create_task(self._run(), name="stream-hub")
        waiter = asyncio.Event()
        for request_id, last in after.items():
            stream = self._streams.get(request_id)
            if stream is None:
                own_here = own and self.wake_id is not None
                self._streams[request_id] = _Stream(last, waiter, ends_only=ends_only, own=own_here)
                if self.latency is not None:
                    self.latency.join(request_id, last)
                await self._wake()
            else:
                stream.waiter = waiter
                if stream.buffer and (not ends_only or any(run.finished for _, run in stream.buffer)):
                    waiter.set()
        if not waiter.is_set() and block_ms:
            await _wait(waiter, block_ms / 1000)
            if not any(self._streams[r].buffer for r in after if r in self._streams):
                waiter.clear()  # quiet: a wake may have been lost, so the streams are read directly
                await self._recheck(after)
                await _wait(waiter, RECHECK_WAIT_S)
        return [(request_id, entry_id, run) for request_id in after for entry_id, run in self._take(request_id)]

    def leave(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is not None and self.latency is not None:
                self.latency.leave(request_id)

    async def _recheck(self, request_ids: dict[str, str]) -> None:
        """Quiet for a whole wait: read these streams directly next (a wake may have been lost)."""
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.woken = True
        await self._wake()

    async def _wake(self) -> None:
        self._joined.set()
        await self._unblock()

    def _take(self, request_id: str) -> list[store.StreamEntry]:
        """What arrived after the reader's start or its last take (readers drop repeats anyway)."""
        stream = self._streams.get(request_id)
        if stream is None or not stream.buffer:
            return []
        entries, stream.buffer = stream.buffer, []
        return entries

    async def _unblock(self) -> None:
        """End the blocked XREAD, once per read: the streams that join while it is being ended (a
        burst's) are in the next read anyway, and need no CLIENT UNBLOCK of their own."""
        client_id, self._blocked_id = self._blocked_id, None
        for _ in range(UNBLOCK_TRIES):
            if client_id is None or await self._unblocker.client_unblock(client_id):
                return
            await asyncio.sleep(0.001)  # sent but not yet blocked in Redis: try again

    async def _run(self) -> None:
        delay = 0.05
        while True:
            conn = None
            try:
                conn = await self._connection()  # one connection for the hub's blocking reads
                client_id = await conn.client_id()
                await conn.client_setname(hub_name(self.keys))  # CLIENT LIST tells the hub's blocked read
                while True:
                    await self._read_once(conn, client_id)
                    delay = 0.05
            except OUTAGE_ERRORS as exc:
                log.warning("stream hub: Redis unreachable (%s): retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except Exception:  # never silently: every stream of this producer depends on this task
                log.exception("stream hub: read failed; retrying in %.1f s", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            finally:
                self._blocked_id = None
                if conn is not None:
                    await conn.aclose()
                if self._unblocker is not self.redis:
                    await self._unblocker.aclose()
                    self._unblocker = self.redis

    async def _connection(self) -> aioredis.Redis:
        """One server: a connection of the client's. A cluster: one to the node of the wake stream's
        slot (its node may change with a failover: an outage makes a new one), and a client there
        to unblock it."""
        if not self.cluster:
            return self.redis.client()
        self._unblocker = await node_client(self.redis, self.keys.wake(self.wake_id or "none"))
        return self._unblocker.client()  # a connection of that client's own: CLIENT UNBLOCK comes on another

    async def _keep_wake_stream(self, conn: aioredis.Redis) -> None:
        """The wake stream exists while this hub does (publishers never create one: NOMKSTREAM)."""
        if self.wake_id is None or time.monotonic() < self._wake_refresh:
            return
        self._wake_refresh = time.monotonic() + WAKE_REFRESH_S
        key = self.keys.wake(self.wake_id)
        async with conn.pipeline(transaction=True) as pipe:
            pipe.xadd(key, {"hub": "up"}, maxlen=WAKE_MAXLEN, approximate=True)
            pipe.expire(key, WAKE_TTL_S)
            entry_id, _ = await pipe.execute()
        if self._wake_cursor == "$":  # the first: wakes after it are ours
            self._wake_cursor = entry_id

    async def _read_once(self, conn: aioredis.Redis, client_id: int) -> None:
        if not self._streams:
            self._joined.clear()
            await self._joined.wait()
        self._joined.clear()
        await self._keep_wake_stream(conn)
        names = {
            self.keys.chunks(request_id): request_id
            for request_id, stream in self._streams.items()
            if stream.woken or not stream.own
        }
        woken = any(self._streams[rid].woken for rid in names.values())
        streams = {key: self._streams[request_id].cursor for key, request_id in names.items()}
        for request_id in names.values():
            self._streams[request_id].woken = False
        if self.cluster:
            reply = await self._read_spread(conn, client_id, streams, woken)
        else:
            if self.wake_id is not None:
                streams[self.keys.wake(self.wake_id)] = self._wake_cursor
            reply = await self._blocking(conn, client_id, streams, None if woken else self.block_ms)
        now = time.monotonic()
        for key, entries in reply or []:
            if key in names:
                self._deliver(names[key], entries, now)
            elif entries:
                self._wake_cursor = entries[-1][0]
                self._mark_woken(entries)

    async def _blocking(self, conn: aioredis.Redis, client_id: int, streams: dict, block_ms: int | None) -> list:
        self._blocked_id = client_id
        try:  # nothing woken: block until a wake (or a foreign stream's entry) comes
            return await conn.xread(streams, block=block_ms) or []
        finally:
            self._blocked_id = None

    async def _read_spread(self, conn: aioredis.Redis, client_id: int, streams: dict, woken: bool) -> list:
        """A cluster's read: the streams named (without blocking, a read per slot), then the wake
        stream (blocking when nothing was woken; at most ``FOREIGN_POLL_MS`` with foreign streams)."""
        reply = await xread_spread(self.redis, streams) if streams else []
        foreign = any(not stream.own for stream in self._streams.values())
        block_ms = None if woken else (min(FOREIGN_POLL_MS, self.block_ms) if foreign else self.block_ms)
        if self.wake_id is None:
            if block_ms:
                await _wait(self._joined, block_ms / 1000)
            return reply
        wake = {self.keys.wake(self.wake_id): self._wake_cursor}
        return reply + await self._blocking(conn, client_id, wake, block_ms)

    def _deliver(self, request_id: str, entries: list, now: float) -> None:
        stream = self._streams.get(request_id)
        if stream is None or not entries:  # None: its reader left meanwhile
            return
        stream.cursor = entries[-1][0]
        runs = self._parse(request_id, entries)
        if self.latency is not None:
            self.latency.arrived(request_id, runs, now)
        stream.buffer += runs
        if runs and (not stream.ends_only or any(run.finished for _, run in runs)):
            stream.waiter.set()

    def _mark_woken(self, entries: list) -> None:
        """A wake entry names the requests a flush wrote (``r``: ids, space-separated)."""
        for _, fields in entries:
            for request_id in fields.get("r", "").split():
                stream = self._streams.get(request_id)
                if stream is not None:
                    stream.woken = True

    @staticmethod
    def _parse(request_id: str, entries: list) -> list[store.StreamEntry]:
        runs = []
        for entry_id, fields in entries:
            try:
                runs.append((entry_id, parse_run(fields)))
            except ValueError as exc:  # skipped: a request left without its end ends from its status hash
                log.error("stream hub: unreadable entry %s of %s: %s", entry_id, request_id, exc)
        return runs
