"""Plays the router's and the worker's side of the protocol against the real
Redis, so producer tests need no model: take a request from the ingress
stream, write chunks (durable stream + pub/sub) and status like a worker.

Chunks go out in format 2 (``ChunkRun``), as workers write them: ``token``
writes a run of one, ``generate`` runs of ``run_len`` tokens (a reader sees a
token at a time either way); ``append_v1`` writes a format-1 entry, as a
worker before runs did."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis
import uvicorn

from producer.app import create_app
from shared import codec, ingress
from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.embedded_redis import free_port
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import ensure_group_async
from shared.schemas import FinishReason, GenerateRequest, RequestMeta, RequestStatus
from tests.waiting import MUST_HAPPEN_S

Reply = Callable[[GenerateRequest], tuple[list[str], FinishReason]]


async def stop_task(task: asyncio.Task, stop: asyncio.Event, timeout_s: float = 10.0) -> None:
    """Ask a background loop to stop and wait for it, without ever hanging the test.

    Neither ``task.cancel()`` nor ``suppress(CancelledError)`` here: a cancel
    can be lost inside the Redis client's read (CI once hung 600 s that way),
    and suppressing CancelledError around ``await task`` would also swallow a
    cancel aimed at the test itself.
    """
    stop.set()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise AssertionError(f"the background loop did not stop within {timeout_s} s")
    task.result()  # its own error, if it had one


def fake_top(token_id: int, k: int) -> list[tuple[int, float]]:
    """k alternatives: the chosen token (-0.25), then token_id + 1, + 2, ... at -1, -2, ..."""
    return [(token_id, -0.25)] + [(token_id + i, -float(i)) for i in range(1, k)]


def now_ms() -> int:
    return int(time.time() * 1000)


@contextlib.asynccontextmanager
async def serving(settings, tokenizer) -> AsyncIterator[str]:
    """A real uvicorn server of the producer app (real sockets: disconnects, the openai client)."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings, tokenizer=tokenizer), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


class FakeWorker:
    def __init__(self, redis: aioredis.Redis, keys: Keys, worker_id: str = "fake-worker", ttl_s: int = 60) -> None:
        self.redis, self.keys, self.worker_id, self.ttl_s = redis, keys, worker_id, ttl_s
        self.reply_to: dict[str, str] = {}  # request id -> its producer's wake stream id

    async def take(self, timeout_s: float = MUST_HAPPEN_S) -> GenerateRequest:
        """The next ingress request of any class (``shared.ingress``), read and acked as a router
        would; status set to running."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            streams = [stream for _, stream in await ingress.streams_async(self.redis, self.keys)]
            for stream in streams:
                await ensure_group_async(self.redis, stream, ROUTER_GROUP)
            reply = await self.redis.xreadgroup(
                ROUTER_GROUP, "fake-router", dict.fromkeys(streams, ">"), count=1, block=100
            )
            if reply:
                stream, entries = reply[0]
                entry_id, fields = entries[0]
                await self.redis.xack(stream, ROUTER_GROUP, entry_id)
                request = codec.from_entry(GenerateRequest, fields)
                if request.reply_to is not None:
                    self.reply_to[request.id] = request.reply_to
                await self.set_meta(
                    request.id,
                    status=RequestStatus.RUNNING,
                    worker=self.worker_id,
                    dispatched_ms=now_ms(),
                    started_ms=now_ms(),
                )
                return request
        raise TimeoutError("no request arrived on the ingress stream")

    async def set_meta(self, request_id: str, **fields) -> None:
        """HSET the fields; an ending (``finished_ms``) also TTLs the request's keys, as mark_ended does."""
        await self.redis.hset(self.keys.meta(request_id), mapping=RequestMeta.fields(**fields))
        if "finished_ms" in fields:
            for key in self.keys.all_request_keys(request_id):
                await self.redis.expire(key, self.ttl_s)

    async def append(self, chunk: TokenChunk) -> str:
        """The chunk as a run of one (format 2) to the durable stream, published; the entry id."""
        return await self.append_run(ChunkRun.of(chunk))

    async def append_run(self, run: ChunkRun) -> str:
        """XADD the run to the durable stream, publish it and wake its producer, as a publisher's
        flush does; returns the entry id."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.chunks(run.request_id), codec.entry(run))
            pipe.publish(self.keys.channel(run.request_id), codec.encode(run))
            reply_to = self.reply_to.get(run.request_id)
            if reply_to is not None:
                pipe.xadd(self.keys.wake(reply_to), {"r": run.request_id}, nomkstream=True)
            entry_id, *_ = await pipe.execute()
        return entry_id

    async def append_v1(self, chunk: TokenChunk) -> str:
        """The chunk as format 1 wrote it: an entry of its own."""
        return await self.redis.xadd(self.keys.chunks(chunk.request_id), codec.entry(chunk))

    async def token(
        self,
        request_id: str,
        index: int,
        text: str,
        *,
        token_id: int | None = None,
        finish_reason: FinishReason | None = None,
        choice: int = 0,
        num_top: int = 0,
    ) -> str:
        """A token chunk (id 100 + index unless given, logprob -0.25); with ``num_top``, that many
        alternatives as a worker reports them: ``fake_top`` (the chosen token first)."""
        token_id = 100 + index if token_id is None else token_id
        return await self.append(
            TokenChunk(
                request_id=request_id,
                index=index,
                choice=choice,
                token_id=token_id,
                text=text,
                logprob=-0.25,
                top_logprobs=fake_top(token_id, num_top) if num_top else None,
                finished=finish_reason is not None,
                finish_reason=finish_reason,
            )
        )

    async def generate(
        self,
        request: GenerateRequest,
        texts: list[str],
        finish_reason: FinishReason = "length",
        delay_s: float = 0.0,
        run_len: int = 1,
    ) -> list[str]:
        """One token per text, in runs of ``run_len``, the last one finished; then the final status.
        A group's choice c > 0 gets each text with c appended; choices interleave a run at a time,
        highest first. Tokens carry the alternatives the request asked for (``fake_top``). Returns
        each token's event id, in stream order, as readers number them (``entry`` for a run's last
        token, ``entry.k`` for the k-th before it)."""
        event_ids = []
        for first in range(0, len(texts), run_len):
            if delay_s:
                await asyncio.sleep(delay_s)
            part = texts[first : first + run_len]
            last = first + len(part) == len(texts)
            for choice in reversed(range(request.n)):
                ids = [100 + first + i for i in range(len(part))]
                num_top = request.params.top_logprobs
                run = ChunkRun(
                    request_id=request.id,
                    choice=choice,
                    index=first,
                    token_ids=ids,
                    texts=[f"{text}{choice}" if choice else text for text in part],
                    logprobs=[-0.25] * len(part),
                    top_logprobs=[fake_top(i, num_top) for i in ids] if num_top else None,
                    finished=last,
                    finish_reason=finish_reason if last else None,
                )
                entry_id = await self.append_run(run)
                event_ids += [f"{entry_id}.{k}" for k in range(len(part) - 1)] + [entry_id]
        await self.set_meta(
            request.id,
            status=RequestStatus.FINISHED,
            finish_reason=finish_reason,
            output_tokens=len(texts) * request.n,
            finished_ms=now_ms(),
        )
        return event_ids

    async def end(
        self, request_id: str, index: int, status: RequestStatus, reason: FinishReason, error: str | None = None
    ) -> None:
        """End without a token of its own (cancelled, failed): terminal chunk, then status."""
        await self.append(
            TokenChunk(
                request_id=request_id, index=index, token_id=None, finished=True, finish_reason=reason, error=error
            )
        )
        await self.set_meta(
            request_id, status=status, finish_reason=reason, error=error, output_tokens=index, finished_ms=now_ms()
        )

    async def wait_cancel(self, request_id: str, timeout_s: float = MUST_HAPPEN_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.redis.exists(self.keys.cancel(request_id)):
                return True
            await asyncio.sleep(0.02)
        return False

    async def serve(self, reply: Reply, seen: list[GenerateRequest], stop: asyncio.Event) -> None:
        """Answer every request with ``reply(request)`` (texts, finish reason) until ``stop`` is set."""
        while not stop.is_set():
            try:
                request = await self.take(timeout_s=0.3)
            except TimeoutError:
                continue
            seen.append(request)
            texts, reason = reply(request)
            await self.generate(request, texts, finish_reason=reason)

    @contextlib.asynccontextmanager
    async def answering(self, reply: Reply) -> AsyncIterator[list[GenerateRequest]]:
        """Run ``serve`` in the background; yields the list of requests it took."""
        seen: list[GenerateRequest] = []
        stop = asyncio.Event()
        task = asyncio.create_task(self.serve(reply, seen, stop))
        try:
            yield seen
        finally:
            await stop_task(task, stop)
