"""Follow a request's durable chunk stream and turn it into SSE.

The reader blocks on XREAD from the last entry it saw, takes each entry's
run of tokens one chunk at a time, drops chunks whose (choice, index) it
already delivered (a re-dispatched request may repeat indexes) and stops
after the finished chunk of every choice (a group's n samples share the
stream; a chunk without a token ends them all). A chunk's event id is its
entry's id, with ``.k`` for the k-th token of a run when more follow it in
that entry (``1700000000000-0.3``): SSE ids, so a client resumes with
``Last-Event-ID`` exactly after the token it got, even inside a run. When the stream stays quiet it looks at the
status hash (every ``STATUS_CHECK_EVERY``-th quiet read), so a request that ended (or expired) without a
terminal chunk cannot leave a client waiting forever. A stream that stops early cancels its
request only when the client left: when the producer itself stops, its open
streams end (within a read, before uvicorn's grace runs out and it cancels
them) and their requests run on; a client resumes one through
``/v1/requests/{id}/stream``. Reads ride out a Redis outage of up
to ``redis_outage_s`` (reconnecting with backoff) before they give up.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
import redis.asyncio as aioredis
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from producer import store
from producer.api.api_types import StreamEvent, StreamToken
from producer.api.errors import error_response, retry_later
from producer.deps import Services
from producer.redis_client import with_reconnect
from producer.streams.stream_hub import StreamHub
from shared import codec
from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.keys import Keys
from shared.schemas import FinishReason, RequestMeta, RequestStatus

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[bool]]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
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


def native_event(chunk: TokenChunk, prompt_tokens: int) -> str:
    """A ``/generate_stream`` event exactly as LightLLM frames it: ``data:`` without a space."""
    count = chunk.index + (chunk.token_id is not None)
    token = StreamToken(
        id=chunk.token_id,
        text=chunk.text,
        logprob=chunk.logprob,
        count_output_tokens=count,
        prompt_tokens=prompt_tokens,
    )
    event = StreamEvent(token=token, finished=chunk.finished, finish_reason=chunk.finish_reason, error=chunk.error)
    return f"data:{event.to_json()}\n\n"


def replay_event(event_id: str | None, chunk: TokenChunk) -> str:
    """A ``/v1/requests/{id}/stream`` event: one token's chunk, its id the token's place in the stream."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {codec.encode(chunk)}\n\n"


def _offset(event_id: str) -> int:
    """The token's place in its entry's run (the last token's id has none: past every other)."""
    _, dot, k = event_id.partition(".")
    return int(k) if dot else 1 << 62


async def shielded(action: Callable[[], Awaitable[Any]]) -> None:
    """Run a clean-up that must happen even while the caller is being cancelled."""
    with anyio.CancelScope(shield=True):
        try:
            await action()
        except Exception:
            log.exception("clean-up failed")


def server_stopping() -> bool:
    """True once uvicorn was told to stop (SIGTERM, SIGINT). uvicorn shows an app no shutdown
    coming; its signal handler is its ``Server.handle_exit``, whose ``should_exit`` says it."""
    server = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return bool(getattr(server, "should_exit", False))


DISCONNECT_CHECK_S = 0.25  # how often a follow asks whether its client left (a cancel waits that long)


def until_stopping(disconnected: Check | None) -> Check:
    """``disconnected`` (asked at most every DISCONNECT_CHECK_S: a follow that wakes per run of
    chunks would ask hundreds of times a second under a burst), or the producer stopping: either
    ends a follow early."""
    next_ask = 0.0

    async def check() -> bool:
        nonlocal next_ask
        if server_stopping():
            return True
        if disconnected is None or time.monotonic() < next_ask:
            return False
        next_ask = time.monotonic() + DISCONNECT_CHECK_S
        return await disconnected()

    return check


async def abandon_if_left(
    follower: Follower, disconnected: Check | None, on_abandon: Callable[[], Awaitable[Any]] | None
) -> None:
    """``on_abandon`` for a stream that stopped before the end because its client left.

    Not when the producer stops: uvicorn's shutdown cancels open streams after its grace
    while their clients are still connected, and those requests must run on (the client
    resumes them by id). The server's receive channel tells the two apart: it reports
    ``http.disconnect`` only once the client's connection is gone.
    """
    if on_abandon is None or follower.finished:
        return
    if disconnected is not None:
        with anyio.CancelScope(shield=True):
            try:
                if not await disconnected():
                    log.info(
                        "a stream stopped while its client is still connected (the producer is stopping): "
                        "its request runs on"
                    )
                    return
            except Exception:  # cannot tell: keep the request, a client can still cancel it by id
                return
    await shielded(on_abandon)


async def sse(
    follower: ChunkFollower,
    render: Callable[[str | None, TokenChunk], str],
    disconnected: Check | None = None,
    on_abandon: Callable[[], Awaitable[Any]] | None = None,
) -> AsyncIterator[str]:
    """Rendered events; ``on_abandon`` runs if the client leaves before the end."""
    try:
        async for entry_id, chunk in follower.follow(until_stopping(disconnected)):
            yield render(entry_id, chunk)
    finally:
        await abandon_if_left(follower, disconnected, on_abandon)


class Follower(Protocol):
    """What ``collect`` and ``rendered`` read: a ``ChunkFollower``, or several merged."""

    ends_only: bool

    @property
    def finished(self) -> bool: ...
    def follow(self, disconnected: Check | None = None) -> AsyncIterator[tuple[str | None, TokenChunk]]: ...


def unanswered(request_ids: list[str]) -> Response:
    """A whole answer's route whose follow ended before the end: a 499 when its client left (nobody
    reads it); when this producer is stopping, a 503 naming the requests, which run on (an empty 499
    left a ``/generate`` client without the id to poll its answer by: the walkthrough's finding)."""
    if not server_stopping():
        return Response(status_code=499)
    where = ", ".join(f"/v1/requests/{request_id}" for request_id in request_ids)
    error = retry_later(
        503,
        f"this producer is stopping; the request runs on and its answer will be at {where} (any producer)",
        "producer_stopping",
        1,
    )
    error.headers = {**(error.headers or {}), "X-Request-Id": request_ids[0]}
    return error_response(error.status, error.detail, error.headers)


async def collect(
    follower: Follower, disconnected: Check, on_abandon: Callable[[], Awaitable[Any]]
) -> list[TokenChunk] | None:
    """Every chunk up to the finished one; None (after ``on_abandon``) if the client left first."""
    chunks: list[TokenChunk] = []
    follower.ends_only = True  # nothing is answered before the end: read at the end, not per run
    try:
        async for _, chunk in follower.follow(until_stopping(disconnected)):
            chunks.append(chunk)
    finally:
        await abandon_if_left(follower, disconnected, on_abandon)
    return chunks if follower.finished else None


class Renderer(Protocol):
    def start(self) -> list[str]: ...
    def chunk(self, chunk: TokenChunk) -> list[str]: ...
    def end(self) -> list[str]: ...


async def rendered(
    follower: Follower, renderer: Renderer, disconnected: Check, on_abandon: Callable[[], Awaitable[Any]]
) -> AsyncIterator[str]:
    """Like ``sse`` for renderers that frame the stream (an opening event, a closing ``[DONE]``)."""
    try:
        for event in renderer.start():
            yield event
        async for _, chunk in follower.follow(until_stopping(disconnected)):
            for event in renderer.chunk(chunk):
                yield event
        if follower.finished:
            for event in renderer.end():
                yield event
    finally:
        await abandon_if_left(follower, disconnected, on_abandon)


class EventStream(StreamingResponse):
    """SSE response that always closes its generator, so its clean-up runs at once
    (Starlette leaves it to the garbage collector when the client vanishes)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], status_code: int = 200, request_id: str | None = None) -> None:
        # X-Request-Id: the id to poll (GET /v1/requests/{id}) or cancel with while the stream runs
        headers = SSE_HEADERS if request_id is None else {**SSE_HEADERS, "X-Request-Id": request_id}
        super().__init__(content, status_code=status_code, headers=headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
