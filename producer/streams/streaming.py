"""Follow a request's durable chunk stream, one chunk at a time, exactly once each.

The reader blocks on XREAD from the last entry it saw, takes each entry's
run of tokens one chunk at a time, drops chunks whose (choice, index) it
already delivered (a re-dispatched request may repeat indexes) and stops
after the finished chunk of every choice (a group's n samples share the
stream; a chunk without a token ends them all). A chunk's event id is its
entry's id, with ``.k`` for the k-th token of a run when more follow it in
that entry (``1700000000000-0.3``): SSE ids, so a client resumes with
``Last-Event-ID`` exactly after the token it got, even inside a run. When the stream stays quiet it looks at the
status hash (every ``STATUS_CHECK_EVERY``-th quiet read), so a request that ended (or expired) without a
terminal chunk cannot leave a client waiting forever. Reads ride out a Redis outage of up
to ``redis_outage_s`` (reconnecting with backoff) before they give up. What the routes answer from a
follow (SSE, whole answers, an early end) is ``producer.streams.responses``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aioredis

from producer import store
from producer.deps import Services
from producer.redis_client import with_reconnect
from producer.streams.stream_hub import StreamHub
from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.keys import Keys
from shared.schemas import FinishReason, RequestMeta, RequestStatus

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[bool]]
# A quiet stream's status-hash read, once per this many quiet reads (``stream_block_ms`` each), not
# after every one: a queued request's follower read it once a second for as long as it waited, each
# a round trip to the control slot's primary (issue 30; with the dashboard tracker's reads, 3.4
# HGETALLs a request in a 200-request burst). An end without a terminal chunk is a crash's
# leftover, so the delay (up to this many reads) costs little.
STATUS_CHECK_EVERY = 5
FINISH_BY_STATUS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED: "stop",
    RequestStatus.CANCELLED: "cancelled",
    RequestStatus.FAILED: "error",
    RequestStatus.EXPIRED: "expired",
}


class ChunkFollower:
    """One reader of one request's chunk stream; ``finished`` once it saw the end of all ``n`` choices."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        request_id: str,
        block_ms: int,
        outage_s: float = 0.0,
        n: int = 1,
        hub: StreamHub | None = None,
    ) -> None:
        self.redis, self.keys, self.request_id, self.block_ms = redis, keys, request_id, block_ms
        self.outage_s = outage_s
        self.hub = hub  # the app's shared XREAD (None: a blocking read of our own, e.g. in a batch job)
        self.n = n
        self.ends_only = False  # set by ``collect``: a whole answer needs waking only at the end
        self.own = False  # submitted by this producer: its publisher wakes the hub (``follower``)
        self.last_id = "0-0"
        self.next_index = [0] * n  # per choice: the next index to deliver
        self.done: set[int] = set()  # choices that ended
        self.finished = False
        self._held: list[tuple[str, TokenChunk]] = []  # a resumed run's rest, delivered first
        self._quiet = 0  # quiet reads since the last run (``ending_without_chunk``)

    async def resume_after(self, event_id: str) -> None:
        """Continue after ``event_id`` (``entry`` or ``entry.k``, as ``event_id`` makes them), as if
        every chunk up to it was delivered."""
        entry_id, _, offset = event_id.partition(".")
        for found_id, run in await store.read_range(self.redis, self.keys, self.request_id, "-", entry_id):
            rest = self.accept(found_id, run)
            if found_id == entry_id and offset:
                self._held = [(e, c) for e, c in rest if _offset(e) > int(offset)]
        self.last_id = entry_id

    def accept(self, entry_id: str, run: ChunkRun) -> list[tuple[str, TokenChunk]]:
        """(event id, chunk) to deliver of the entry ``entry_id``'s run, a token at a time."""
        self._quiet = 0
        tokens = run.tokens()
        last = len(tokens) - 1
        out = []
        for k, token in enumerate(tokens):
            event_id = entry_id if k == last else f"{entry_id}.{k}"
            out += [(event_id, chunk) for chunk in self.accept_chunk(token)]
        return out

    def accept_chunk(self, chunk: TokenChunk) -> list[TokenChunk]:
        """The chunks to deliver: none for a repeat of a delivered (choice, index); one per
        unfinished choice for a chunk without a token that ends the request."""
        if chunk.finished and chunk.token_id is None:
            ending = [
                chunk.model_copy(update={"choice": c, "index": self.next_index[c]})
                for c in range(self.n)
                if c not in self.done
            ]
            self.done.update(range(self.n))
            self.finished = True
            return ending
        choice = chunk.choice
        if not 0 <= choice < self.n or choice in self.done:
            return []
        if chunk.index < self.next_index[choice]:
            if not chunk.finished:
                return []
            # A repeated index that ends the sample still ends it, without its token.
            chunk = chunk.model_copy(
                update={
                    "index": self.next_index[choice],
                    "token_id": None,
                    "text": "",
                    "logprob": None,
                    "top_logprobs": None,
                }
            )
        self.next_index[choice] = chunk.index + (chunk.token_id is not None)
        if chunk.finished:
            self.done.add(choice)
            self.finished = len(self.done) == self.n
        return [chunk]

    async def follow(self, disconnected: Check | None = None) -> AsyncIterator[tuple[str | None, TokenChunk]]:
        """(entry id, chunk) until the finished chunk, or until ``disconnected()``."""
        try:
            async for item in self._follow(disconnected):
                yield item
        finally:
            if self.hub is not None:
                self.hub.leave([self.request_id])

    async def _follow(self, disconnected: Check | None) -> AsyncIterator[tuple[str | None, TokenChunk]]:
        held, self._held = self._held, []
        for item in held:
            yield item
        while not self.finished:
            if disconnected is not None and await disconnected():
                return
            entries = await with_reconnect(self._read_next, self.outage_s)
            if not entries:
                for chunk in await with_reconnect(self.ending_without_chunk, self.outage_s):
                    yield None, chunk
                continue
            for entry_id, run in entries:
                self.last_id = entry_id
                for item in self.accept(entry_id, run):
                    yield item
                if self.finished:
                    return

    async def _read_next(self) -> list[store.StreamEntry]:
        if self.hub is not None:
            found = await self.hub.read_many({self.request_id: self.last_id}, self.block_ms, self.ends_only, self.own)
            return [(entry_id, run) for _, entry_id, run in found]
        return await store.read_after(self.redis, self.keys, self.request_id, self.last_id, self.block_ms)

    async def ending_without_chunk(self) -> list[TokenChunk]:
        """Terminal chunks made from the status hash when the stream has none (after a quiet read;
        the hash is read on every ``STATUS_CHECK_EVERY``-th one in a row)."""
        self._quiet += 1
        if self._quiet % STATUS_CHECK_EVERY:
            return []
        meta = await store.read_meta(self.redis, self.keys, self.request_id)
        if meta is not None and not meta.status.is_terminal:
            return []
        late = await store.read_after(self.redis, self.keys, self.request_id, self.last_id, block_ms=None)
        if late:  # the terminal chunk arrived just after the status: read it normally
            return []
        choice = min(set(range(self.n)) - self.done)
        return self.accept_chunk(ending_from_meta(self.request_id, self.next_index[choice], meta, choice))


def follower(services: Services, request_id: str, n: int = 1, own: bool = True) -> ChunkFollower:
    """A follower with the app's settings (block time, outage grace); ``n``: the request's samples;
    ``own``: submitted by this producer (its writer wakes this producer's hub), not a replay of
    a request from anywhere."""
    settings = services.settings
    reader = ChunkFollower(
        services.redis, services.keys, request_id, settings.stream_block_ms, settings.redis_outage_s, n, services.hub
    )
    reader.own = own
    return reader


def ending_from_meta(request_id: str, index: int, meta: RequestMeta | None, choice: int = 0) -> TokenChunk:
    if meta is None:
        reason, error = "error", "request record expired or was removed"
    else:
        reason, error = meta.finish_reason or FINISH_BY_STATUS[meta.status], meta.error
    return TokenChunk(
        request_id=request_id,
        index=index,
        choice=choice,
        token_id=None,
        finished=True,
        finish_reason=reason,
        error=error,
    )


def _offset(event_id: str) -> int:
    """The token's place in its entry's run (the last token's id has none: past every other)."""
    _, dot, k = event_id.partition(".")
    return int(k) if dot else 1 << 62
