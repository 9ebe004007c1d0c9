"""Answering from a follow: SSE events, whole answers, and what a follow that ends early means.

A stream that stops early cancels its request only when the client left: when the producer itself
stops, its open streams end (within a read, before uvicorn's grace runs out and it cancels them) and
their requests run on; a client resumes one through ``/v1/requests/{id}/stream``, and a whole-answer
route waiting at the stop answers 503 with the request's id (``unanswered``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import anyio
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from producer.api.api_types import StreamEvent, StreamToken
from producer.api.errors import error_response, retry_later
from producer.streams.streaming import Check, ChunkFollower
from shared import codec
from shared.chunk_schemas import TokenChunk

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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
