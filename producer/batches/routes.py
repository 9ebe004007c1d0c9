"""Batch jobs: ``POST /v1/batches`` (a JSONL file as the body), ``GET /v1/batches/{id}``
(progress), ``GET /v1/batches/{id}/output`` (the output JSONL), ``POST /v1/batches/{id}/cancel``.

A file is checked line by line before anything is written; a good one is
stored with the batch's record and its rq job in one transaction. The job
(``producer.batches.job.run_batch``, run by ``lightq rq-worker``) does the rest.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated

import redis
import redis.asyncio as aioredis
from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel
from rq import Callback, Queue, Retry
from rq.serializers import JSONSerializer

from producer.api.errors import ApiError, bad_request
from producer.batches.job import on_failure, run_batch
from producer.batches.records import (
    BatchRecord,
    BatchStatus,
    endpoint_of,
    line_numbers,
    new_batch_id,
    now_s,
    parse_lines,
    validate_lines,
)
from producer.deps import Services, ServicesDep
from producer.edge.auth import Caller, CallerDep
from shared.producer_settings import ProducerSettings
from shared.schemas import RequestStatus

router = APIRouter(prefix="/v1/batches")
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")
ERRORS = {404: {"description": "unknown batch"}}
JSONL = "application/jsonl"
FILE_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            JSONL: {
                "schema": {"type": "string", "description": 'one {"custom_id", "method": "POST", "url", "body"} a line'}
            }
        },
    }
}


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchView(BaseModel):
    """OpenAI's batch object, plus ``status_counts`` (lines by where they are now) and ``output_url``."""

    id: str
    object: str = "batch"
    endpoint: str
    status: BatchStatus
    created_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    expires_at: int | None
    request_counts: RequestCounts
    status_counts: dict[str, int]
    output_url: str | None
    error: str | None


class BatchList(BaseModel):
    """OpenAI's list of batches: newest first, ``after`` a batch id for the next page."""

    object: str = "list"
    data: list[BatchView]
    first_id: str | None
    last_id: str | None
    has_more: bool


def owner(caller: Caller) -> str:
    """Whose batches: an API key's (by its hash), or everyone's when keys are off."""
    return caller.key_hash or "open"


def rq_job_id(prefix: str, batch_id: str) -> str:
    """The batch's rq job id (rq allows letters, digits, '_' and '-')."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', prefix)}-{batch_id}"


def valid_batch_id(batch_id: str) -> str:
    if not BATCH_ID.fullmatch(batch_id):
        raise _not_found(batch_id)
    return batch_id


BatchIdDep = Annotated[str, Depends(valid_batch_id)]


def _store(services: Services) -> aioredis.Redis:
    """The Redis of batch records and rq's queue (``RedisSettings.batch_url``): the pool's, or on a
    Redis Cluster the plain one ``--redis_rq_url`` names (rq has no cluster client)."""
    if services.batch_redis is None:
        raise ApiError(
            501,
            "batches need a plain Redis for their queue on a Redis Cluster pool: start with --redis_rq_url",
            code="batches_unavailable",
            kind="server_error",
        )
    return services.batch_redis


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, f"no batch {batch_id}", param="batch_id", code="not_found", kind="not_found_error")


@router.post("", status_code=202, openapi_extra=FILE_DOC)
async def create_batch(request: Request, services: ServicesDep, caller: CallerDep) -> BatchView:
    """Check every line (a 400 names the first bad one; nothing is written), then store and enqueue."""
    try:
        text = (await request.body()).decode("utf-8-sig")  # a byte-order mark (Notepad's) is no JSON
    except UnicodeDecodeError:
        raise bad_request("the file is not UTF-8 text", code="invalid_encoding", reason="invalid_batch") from None
    refuse_openai_file_reference(text)
    _store(services)  # before anything is read: a pool without a place for batches says so
    # Off the event loop: a 200 MB file takes seconds to split and parse.
    lines = await asyncio.to_thread(parse_lines, text, services.settings.batch.max_requests)
    await validate_lines(lines, await asyncio.to_thread(line_numbers, text), services)
    batch_id, ttl_s = new_batch_id(), services.settings.batch.ttl_s
    record = BatchRecord(
        status=BatchStatus.QUEUED,
        endpoint=endpoint_of(lines),
        total=len(lines),
        created_at=now_s(),
        expires_at=now_s() + ttl_s,
        key_hash=caller.key_hash,
    )
    await asyncio.to_thread(submit_job, services.settings, batch_id, text, record, owner(caller))
    return await _view(services, batch_id, record)


def refuse_openai_file_reference(text: str) -> None:
    """OpenAI's SDK sends ``{"input_file_id": ...}`` after an upload to ``/v1/files``, which lightq
    has not: say so, rather than "line 1: custom_id: Field required"."""
    if '"input_file_id"' not in text[:4096] or "\n" in text.strip():
        return
    try:
        body = json.loads(text)
    except ValueError:
        return
    if isinstance(body, dict) and "input_file_id" in body:
        raise bad_request(
            "lightq has no /v1/files: POST the JSONL batch file itself as this request's body "
            "(Content-Type: application/jsonl), or use `lightq batch submit FILE`",
            param="input_file_id",
            code="unsupported_parameter",
            reason="invalid_batch",
        )


def submit_job(settings: ProducerSettings, batch_id: str, text: str, record: BatchRecord, owner: str) -> None:
    """The batch's record, its input, its place in the owner's index and its rq job, in one transaction."""
    keys, batch = settings.redis.keys, settings.batch
    connection = redis.Redis.from_url(settings.redis.batch_url)  # rq wants bytes replies
    try:
        queue = Queue(batch.queue, connection=connection, serializer=JSONSerializer)
        with connection.pipeline(transaction=True) as pipe:
            pipe.multi()  # explicitly, first: rq's enqueue joins a transaction it finds open
            pipe.hset(keys.batch(batch_id), mapping=record.model_dump(exclude_none=True, mode="json"))
            pipe.expire(keys.batch(batch_id), batch.ttl_s)
            pipe.set(keys.batch_input(batch_id), text, ex=batch.ttl_s)
            pipe.zadd(keys.batch_index(owner), {batch_id: record.created_at})
            pipe.expire(keys.batch_index(owner), batch.ttl_s)  # an owner idle for a TTL leaves no index
            queue.enqueue(
                run_batch,
                batch_id,
                settings.model_dump(mode="json"),
                job_id=rq_job_id(settings.redis.key_prefix, batch_id),
                job_timeout=batch.job_timeout_s,
                result_ttl=batch.ttl_s,
                failure_ttl=batch.ttl_s,
                retry=Retry(max=batch.retries) if batch.retries else None,
                on_failure=Callback(on_failure),
                pipeline=pipe,
            )
            pipe.execute()
    finally:
        connection.close()


async def _record_or_404(services: Services, batch_id: str, caller: Caller) -> BatchRecord:
    """The batch's record; another API key's batch is as unknown as a missing one."""
    raw = await _store(services).hgetall(services.keys.batch(batch_id))
    record = BatchRecord.model_validate(raw) if raw else None
    if record is None or not caller.owns(record.key_hash):
        raise _not_found(batch_id)
    return record


async def _view(services: Services, batch_id: str, record: BatchRecord) -> BatchView:
    status = record.status
    if record.cancelling_at and not status.is_terminal:
        status = BatchStatus.CANCELLING
    done = record.completed + record.failed
    return BatchView(
        id=batch_id,
        endpoint=record.endpoint,
        status=status,
        created_at=record.created_at,
        in_progress_at=record.in_progress_at,
        finalizing_at=record.finalizing_at,
        completed_at=record.completed_at,
        failed_at=record.failed_at,
        cancelling_at=record.cancelling_at,
        cancelled_at=record.cancelled_at,
        expires_at=record.expires_at,
        request_counts=RequestCounts(total=record.total, completed=record.completed, failed=record.failed),
        status_counts=await _status_counts(services, batch_id, record.total - done)
        | {"completed": record.completed, "failed": record.failed},
        output_url=f"/v1/batches/{batch_id}/output" if status in _WITH_OUTPUT else None,
        error=record.error,
    )


_WITH_OUTPUT = (BatchStatus.COMPLETED, BatchStatus.CANCELLED, BatchStatus.FAILED)


async def _status_counts(services: Services, batch_id: str, unanswered: int) -> dict[str, int]:
    """Unanswered lines by where they are: not sent yet (pending), queued, running."""
    request_ids = await _store(services).hvals(services.keys.batch_inflight(batch_id))
    async with services.redis.pipeline(transaction=False) as pipe:
        for request_id in request_ids:
            pipe.hget(services.keys.meta(request_id), "status")
        statuses = await pipe.execute()
    queued = sum(status in (None, RequestStatus.QUEUED.value) for status in statuses)
    running = len(statuses) - queued  # running, or ended and about to be recorded
    return {"pending": max(unanswered - len(statuses), 0), "queued": queued, "running": running}


@router.get("", responses={400: {"description": "unknown `after` batch id"}})
async def list_batches(
    services: ServicesDep, caller: CallerDep, limit: int = Query(20, ge=1, le=100), after: str | None = None
) -> BatchList:
    """The caller's batches, newest first; batches past their TTL drop out of the index here."""
    index, store = services.keys.batch_index(owner(caller)), _store(services)
    await store.zremrangebyscore(index, "-inf", now_s() - services.settings.batch.ttl_s)
    start = 0
    if after is not None:
        rank = await store.zrevrank(index, after)
        if rank is None:
            raise bad_request(f"after: no batch {after} in this list", param="after", code="not_found")
        start = rank + 1
    ids = await store.zrevrange(index, start, start + limit)  # one more than asked: is there more?
    views = []
    for batch_id in ids[:limit]:
        raw = await store.hgetall(services.keys.batch(batch_id))
        if raw:  # its record expired before the index was pruned
            views.append(await _view(services, batch_id, BatchRecord.model_validate(raw)))
    return BatchList(
        data=views,
        first_id=views[0].id if views else None,
        last_id=views[-1].id if views else None,
        has_more=len(ids) > limit,
    )


@router.get("/{batch_id}", responses=ERRORS)
async def get_batch(batch_id: BatchIdDep, services: ServicesDep, caller: CallerDep) -> BatchView:
    return await _view(services, batch_id, await _record_or_404(services, batch_id, caller))


@router.get(
    "/{batch_id}/output",
    response_class=Response,
    responses={**ERRORS, 200: {"content": {JSONL: {}}}, 409: {"description": "not finished yet"}},
)
async def get_output(batch_id: BatchIdDep, services: ServicesDep, caller: CallerDep) -> Response:
    """The output JSONL, in input order, once the batch has ended (completed, cancelled or failed)."""
    record = await _record_or_404(services, batch_id, caller)
    if record.status not in _WITH_OUTPUT:
        raise ApiError(
            409,
            f"batch {batch_id} is {record.status.value}: its output is not ready",
            param="batch_id",
            code="batch_not_finished",
        )
    output = await _store(services).get(services.keys.batch_output(batch_id))
    if output is None:
        raise _not_found(batch_id)
    return Response(output, media_type=JSONL)


@router.post("/{batch_id}/cancel", responses=ERRORS)
async def cancel_batch(batch_id: BatchIdDep, services: ServicesDep, caller: CallerDep) -> BatchView:
    """Stop sending the batch's requests and cancel those in the pool; the job then writes the output."""
    record = await _record_or_404(services, batch_id, caller)
    if not record.status.is_terminal and record.cancelling_at is None:
        await _store(services).hset(services.keys.batch(batch_id), "cancelling_at", str(now_s()))
        record = record.model_copy(update={"cancelling_at": now_s()})
    return await _view(services, batch_id, record)
