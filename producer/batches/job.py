"""The rq job that runs a batch: feed its requests into the ingress stream,
at most ``max_in_flight`` at a time, through the preparation and enqueue the
HTTP routes use, follow each one's durable chunk stream to its end, and write
the output JSONL.

The job is resumable: each answered line is recorded (with its counter) in
one transaction, and a line's request id is recorded before its request is
enqueued, so a job that is interrupted and run again (rq's ``Retry``) skips
answered lines, follows the requests already in the pool instead of sending
them twice, and sends the rest. A cancel request stops the sending; requests
already in the pool are cancelled and answered with what they produced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from producer import store
from producer.api.errors import ApiError
from producer.api.submit import enqueue
from producer.batches.records import (
    BatchLine,
    BatchRecord,
    BatchStatus,
    Prepared,
    error_body,
    now_s,
    output_line,
    parse_lines,
    prepare_line,
)
from producer.deps import Services, batch_client
from producer.edge.backlog import Gate
from producer.monitoring.metrics import ProducerMetrics
from producer.streams.streaming import ChunkFollower
from shared.chunk_schemas import TokenChunk
from shared.config import ModelSettings
from shared.keys import Keys
from shared.model_files import load_tokenizer, resolve, served_name
from shared.producer_settings import ProducerSettings
from shared.redis import REDIS_FAILURES, async_client

log = logging.getLogger("lightq.batch")

ROUTE = "batch"  # the route label of requests a batch sends (producer metrics)
BATCH_CANCEL_CHECK_S = 0.5  # a batch's cancel is read at most this often (a batch runs for minutes)
_tokenizers: dict[str, Any] = {}


def tokenizer_for(model: ModelSettings) -> Any:
    """One tokenizer per model and process (``lightq rq-worker`` loads it before forking job processes)."""
    if model.model_dir not in _tokenizers:
        _tokenizers[model.model_dir] = load_tokenizer(resolve(model.model_dir), model.weights_cache)
    return _tokenizers[model.model_dir]


def run_batch(batch_id: str, settings: dict) -> dict:
    """rq entry point; ``settings`` are the accepting producer's, so lines are prepared as it checked them."""
    return asyncio.run(_run(batch_id, ProducerSettings.model_validate(settings)))


async def _run(batch_id: str, settings: ProducerSettings) -> dict:
    services = job_services(settings)
    try:
        return await Feeder(services, batch_id).run()
    finally:
        await services.redis.aclose()
        if services.batch_redis is not services.redis and services.batch_redis is not None:
            await services.batch_redis.aclose()


def job_services(settings: ProducerSettings, tokenizer: Any = None) -> Services:
    """What a job prepares and sends its lines with: the accepting producer's settings, a Redis
    client of its own (the caller closes it) and the model's tokenizer (loaded once a process)."""
    redis = async_client(settings.redis)
    return Services(
        settings=settings,
        keys=settings.redis.keys,
        redis=redis,
        tokenizer=tokenizer if tokenizer is not None else tokenizer_for(settings.model),
        metrics=ProducerMetrics(),
        model_id=served_name(settings.model.model_dir, settings.model.served_model_name),
        # No backlog limit (a batch waits its turn in the queue), but the live pools' sizes: a chat
        # line without max_tokens shares the largest pool among its n answers, as on the route.
        gate=Gate(redis, settings.redis.keys, max_queue_tokens=0, require_workers=False),
        batch_redis=batch_client(settings.redis),
    )


def on_failure(job: Any, connection: Any, exc_type: type, exc: BaseException, traceback: Any) -> None:
    """rq failure callback: a job with no retries left marks its batch failed. What it answered
    stays downloadable, as a cancelled batch's does: the output has every line, in order, the
    unanswered ones with a ``batch_failed`` error; the working records go and the rest keeps
    the batch's TTL (they had none: a failed batch's answers stayed in Redis for good)."""
    if job.retries_left:
        return
    batch_id, settings = job.args
    keys, ttl_s = Keys(settings["redis"]["key_prefix"]), int(settings["batch"]["ttl_s"])
    error = f"the batch job failed: {getattr(exc_type, '__name__', 'error')}: {exc}"
    output, unanswered = failed_output(connection, keys, batch_id, error, int(settings["batch"]["max_requests"]))
    with connection.pipeline(transaction=True) as pipe:
        pipe.set(keys.batch_output(batch_id), output, ex=ttl_s)
        pipe.delete(keys.batch_results(batch_id), keys.batch_inflight(batch_id))
        pipe.hincrby(keys.batch(batch_id), "failed", unanswered)
        pipe.hset(
            keys.batch(batch_id),
            mapping=BatchRecord.fields(
                status=BatchStatus.FAILED, failed_at=now_s(), expires_at=now_s() + ttl_s, error=error
            ),
        )
        pipe.expire(keys.batch(batch_id), ttl_s)
        pipe.expire(keys.batch_input(batch_id), ttl_s)
        pipe.execute()


def failed_output(connection: Any, keys: Keys, batch_id: str, error: str, max_requests: int) -> tuple[str, int]:
    """(the output JSONL of a failed batch, how many of its lines had no answer). ``connection``
    is rq's (bytes replies). Requests still in the pool run to their ends unread."""
    answered = {int(i): line.decode() for i, line in connection.hgetall(keys.batch_results(batch_id)).items()}
    sent = {int(i): rid.decode() for i, rid in connection.hgetall(keys.batch_inflight(batch_id)).items()}
    text = connection.get(keys.batch_input(batch_id))
    try:
        lines = parse_lines(text.decode(), max_requests) if text is not None else []
    except ApiError:  # checked at submission: only a changed limit gets here; keep what was answered
        lines = []
    failure = {"code": "batch_failed", "message": error}
    out = [
        answered[i] if i in answered else output_line(line.custom_id, sent.get(i), None, None, error=failure)
        for i, line in enumerate(lines)
    ] or [answered[i] for i in sorted(answered)]
    return "".join(line + "\n" for line in out), max(len(lines) - len(answered), 0)


class Feeder:
    def __init__(self, services: Services, batch_id: str) -> None:
        self.services, self.batch_id = services, batch_id
        self.redis, self.keys = services.redis, services.keys  # the pool's
        assert services.batch_redis is not None, "a batch job runs only where batches have a Redis"
        self.store = services.batch_redis  # batch records (RedisSettings.batch_url)
        self.limit = services.settings.batch.max_in_flight
        self._cancelled = False
        self._checked_at = 0.0
        self.key_hash: str | None = None  # the submitting API key's: every request of the batch is its own

    async def run(self) -> dict:
        raw = await self.store.hgetall(self.keys.batch(self.batch_id))
        text = await self.store.get(self.keys.batch_input(self.batch_id))
        if not raw or text is None:
            log.warning("batch %s: its records are gone; nothing to do", self.batch_id)
            return {"status": "gone"}
        record = BatchRecord.model_validate(raw)
        if record.status.is_terminal:
            return {"status": record.status.value}
        self.key_hash = record.key_hash
        await self._set(status=BatchStatus.IN_PROGRESS, in_progress_at=record.in_progress_at or now_s())
        lines = parse_lines(text, self.services.settings.batch.max_requests)
        await self._feed(lines)
        return await self._finish(len(lines))

    async def _feed(self, lines: list[BatchLine]) -> None:
        done = {int(i) for i in await self.store.hkeys(self.keys.batch_results(self.batch_id))}
        sent = {int(i): rid for i, rid in (await self.store.hgetall(self.keys.batch_inflight(self.batch_id))).items()}
        slots = asyncio.Semaphore(self.limit)
        tasks: set[asyncio.Task] = set()
        for index, line in enumerate(lines):
            if index in done:
                continue
            await slots.acquire()
            _raise_failed(tasks)
            if index not in sent and await self.cancel_requested():
                slots.release()
                await self._record(
                    index,
                    output_line(
                        line.custom_id,
                        None,
                        None,
                        None,
                        error={
                            "code": "batch_cancelled",
                            "message": "the batch was cancelled before this request was sent",
                        },
                    ),
                )
                continue
            tasks.add(asyncio.create_task(self._one(index, line, sent.get(index), slots)))
        await asyncio.gather(*tasks)

    async def _one(self, index: int, line: BatchLine, sent_id: str | None, slots: asyncio.Semaphore) -> None:
        try:
            request_id = None
            try:
                prepared = await prepare_line(line, self.services)
                request_id = await self._send(index, prepared, sent_id)
                status, body = 200, prepared.render(request_id, await self._follow(request_id, prepared.request.n))
            except ApiError as exc:  # what the route would have answered
                status, body = exc.status, error_body(exc)
            except REDIS_FAILURES:
                raise  # the job fails and rq runs it again: it resumes, this line included
            except Exception as exc:  # a bug answering this line: its own 500, not the batch's failure
                log.exception("batch %s line %d: answering it failed", self.batch_id, index + 1)
                status, body = 500, error_body(line_failed(exc))
            await self._record(index, output_line(line.custom_id, request_id, status, body), ok=status == 200)
        finally:
            slots.release()

    async def _send(self, index: int, prepared: Prepared, sent_id: str | None) -> str:
        """The request id to follow: one an earlier run already sent, or a new one sent now."""
        if sent_id is not None and await self.redis.exists(self.keys.meta(sent_id)):
            return sent_id
        await self.store.hset(self.keys.batch_inflight(self.batch_id), str(index), prepared.request.id)
        await enqueue(prepared.request, ROUTE, self.services, self.key_hash)
        return prepared.request.id

    async def _follow(self, request_id: str, n: int) -> list[TokenChunk]:
        """Every chunk (of all ``n`` samples) to the end; a cancelled batch cancels the request and
        still reads it to its end."""
        follower = ChunkFollower(self.redis, self.keys, request_id, self.services.settings.stream_block_ms, n=n)
        chunks = [chunk async for _, chunk in follower.follow(self.cancel_requested)]
        if not follower.finished:
            await store.request_cancel(self.redis, self.keys, request_id, self.services.settings.redis.request_ttl_s)
            chunks += [chunk async for _, chunk in follower.follow()]
        return chunks

    async def cancel_requested(self) -> bool:
        """Whether a cancel request came (read at most every BATCH_CANCEL_CHECK_S, shared by all followers)."""
        if not self._cancelled and time.monotonic() - self._checked_at >= BATCH_CANCEL_CHECK_S:
            self._checked_at = time.monotonic()
            self._cancelled = bool(await self.store.hget(self.keys.batch(self.batch_id), "cancelling_at"))
        return self._cancelled

    async def _record(self, index: int, line: str, ok: bool = False) -> None:
        """One answered line and its counter, in one transaction (a rerun never counts it twice)."""
        async with self.store.pipeline(transaction=True) as pipe:
            pipe.hset(self.keys.batch_results(self.batch_id), str(index), line)
            pipe.hdel(self.keys.batch_inflight(self.batch_id), str(index))
            pipe.hincrby(self.keys.batch(self.batch_id), "completed" if ok else "failed", 1)
            await pipe.execute()

    async def _finish(self, total: int) -> dict:
        await self._set(status=BatchStatus.FINALIZING, finalizing_at=now_s())
        results = await self.store.hgetall(self.keys.batch_results(self.batch_id))
        output = "".join(results[str(i)] + "\n" for i in range(total))
        # Cancelled only if the cancel reached the run; one that came after the last answer changes nothing.
        status = BatchStatus.CANCELLED if self._cancelled else BatchStatus.COMPLETED
        ttl_s = self.services.settings.batch.ttl_s
        async with self.store.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.batch_output(self.batch_id), output)
            pipe.delete(self.keys.batch_results(self.batch_id), self.keys.batch_inflight(self.batch_id))
            done_at = {"cancelled_at" if status is BatchStatus.CANCELLED else "completed_at": now_s()}
            pipe.hset(
                self.keys.batch(self.batch_id),
                mapping=BatchRecord.fields(status=status, expires_at=now_s() + ttl_s, **done_at),
            )
            for key in (
                self.keys.batch(self.batch_id),
                self.keys.batch_input(self.batch_id),
                self.keys.batch_output(self.batch_id),
            ):
                pipe.expire(key, ttl_s)
            await pipe.execute()
        log.info("batch %s %s: %d lines", self.batch_id, status.value, total)
        return {"status": status.value, "total": total}

    async def _set(self, **fields: Any) -> None:
        await self.store.hset(self.keys.batch(self.batch_id), mapping=BatchRecord.fields(**fields))


def line_failed(exc: BaseException) -> ApiError:
    """A line whose answer could not be built (an unreadable chunk, a bug in rendering): one line's
    500, where it used to fail the whole batch after rq's retries (a red team's poison line)."""
    return ApiError(
        500,
        f"answering this request failed: {type(exc).__name__}: {exc}"[:500],
        code="generation_failed",
        kind="server_error",
    )


def _raise_failed(tasks: set[asyncio.Task]) -> None:
    """Drop finished tasks; re-raise the first failure (the job fails and rq retries it)."""
    for task in [t for t in tasks if t.done()]:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
