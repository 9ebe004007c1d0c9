"""Submit-and-poll: ``/v1/requests`` (submit), ``/{id}`` (status, cancel), ``/{id}/stream`` (replay).

Unlike the native routes, nothing here cancels a request when a client
leaves: the request lives on and can be polled or streamed again. With API
keys, a request is only visible to the key that submitted it (``producer.edge.auth``).
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Header, Response

from producer import store
from producer.api.api_types import BODY_DOC, RequestView, SubmitAccepted
from producer.api.errors import bad_request, not_found
from producer.api.params import check_group
from producer.api.submit import submit
from producer.deps import GenerateBodyDep, RequestIdDep, Services, ServicesDep
from producer.edge.auth import Caller, CallerDep
from producer.streams.responses import EventStream, replay_event, sse
from producer.streams.streaming import follower
from shared.schemas import RequestMeta

router = APIRouter(prefix="/v1/requests")
CANCEL_WAIT_S = 3.0
CANCEL_POLL_S = 0.05
ENTRY_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{0,20}))?(?:\.([0-9]{1,6}))?")
UINT64_MAX = 2**64 - 1


@router.post("", status_code=202, openapi_extra=BODY_DOC)
async def submit_request(body: GenerateBodyDep, services: ServicesDep, caller: CallerDep) -> SubmitAccepted:
    if check_group(body.params.n, body.params.best_of, "parameters.") > 1:
        raise bad_request(
            "parameters.best_of must be 1 here (a request's record holds one output): "
            "use /generate or the OpenAI routes for n > 1",
            param="parameters.best_of",
        )
    queued = await submit(body, "requests", services, caller.key_hash)
    base = f"/v1/requests/{queued.id}"
    return SubmitAccepted(id=queued.id, status_url=base, stream_url=f"{base}/stream")


async def _meta_or_404(services: Services, request_id: str, caller: Caller) -> RequestMeta:
    meta = await store.read_meta(services.redis, services.keys, request_id)
    if meta is None or not caller.owns(meta.key_hash):  # another key's request looks unknown
        raise not_found(request_id)
    return meta


async def request_view(services: Services, request_id: str, meta: RequestMeta) -> RequestView:
    """The status hash plus the (de-duplicated) output so far."""
    reader = follower(services, request_id, n=meta.samples, own=False)
    delivered = [
        chunk
        for entry_id, run in await store.read_range(services.redis, services.keys, request_id)
        for _, chunk in reader.accept(entry_id, run)
    ]
    tokens = [chunk for chunk in delivered if chunk.token_id is not None]
    priority, position = await store.queue_place(services.redis, services.keys, request_id, services.model_id)
    return RequestView(
        id=request_id,
        status=meta.status,
        output_text="".join(chunk.text for chunk in tokens if chunk.choice == 0),
        output_texts=[
            "".join(chunk.text for chunk in tokens if chunk.choice == choice) for choice in range(meta.samples)
        ]
        if meta.samples > 1
        else None,
        output_tokens=max(meta.output_tokens, len(tokens)),
        prompt_tokens=meta.prompt_tokens,
        finish_reason=meta.finish_reason,
        error=meta.error,
        worker=meta.worker,
        created_ms=meta.created_ms,
        dispatched_ms=meta.dispatched_ms,
        taken_ms=meta.taken_ms,
        stepped_ms=meta.stepped_ms,
        started_ms=meta.started_ms,
        finished_ms=meta.finished_ms,
        priority=priority,
        queue_position=position,
        estimated_wait_s=estimated_wait(services, position),
    )


def estimated_wait(services: Services, position: int | None) -> float | None:
    """A queued request's wait at the pool's recent drain rate (the producer's last cluster view):
    a guide, as the rate counts every class and the position moves as better requests arrive."""
    snap = services.metrics.snapshot
    if position is None or snap is None or snap.drain_rate <= 0:
        return None
    return round((position + 1) / snap.drain_rate, 3)


@router.get("/{request_id}", responses={404: {"description": "unknown id"}})
async def get_request(request_id: RequestIdDep, services: ServicesDep, caller: CallerDep) -> RequestView:
    return await request_view(services, request_id, await _meta_or_404(services, request_id, caller))


@router.delete(
    "/{request_id}",
    responses={202: {"description": "cancel requested, not yet done"}, 404: {"description": "unknown id"}},
)
async def cancel_request(
    request_id: RequestIdDep, services: ServicesDep, caller: CallerDep, response: Response
) -> RequestView:
    """Set the cancel key and wait (briefly) for the holder to finalise the request."""
    meta = await _meta_or_404(services, request_id, caller)
    if not meta.status.is_terminal:
        ttl_s = services.settings.redis.request_ttl_s
        await store.request_cancel(services.redis, services.keys, request_id, ttl_s)
        meta = await _wait_terminal(services, request_id, meta)
    response.status_code = 200 if meta.status.is_terminal else 202
    return await request_view(services, request_id, meta)


async def _wait_terminal(services: Services, request_id: str, meta: RequestMeta) -> RequestMeta:
    deadline = time.monotonic() + CANCEL_WAIT_S
    while not meta.status.is_terminal and time.monotonic() < deadline:
        await asyncio.sleep(CANCEL_POLL_S)
        meta = await store.read_meta(services.redis, services.keys, request_id) or meta
    return meta


@router.get("/{request_id}/stream", response_class=EventStream, responses={404: {"description": "unknown id"}})
async def stream_request(
    request_id: RequestIdDep, services: ServicesDep, caller: CallerDep, last_event_id: str | None = Header(None)
) -> EventStream:
    """Replay the chunks as SSE, a token an event (``id:`` its place: the stream entry id, ``.k`` for
    the k-th token of a run that more tokens follow), after ``Last-Event-ID`` if given."""
    meta = await _meta_or_404(services, request_id, caller)
    reader = follower(services, request_id, n=meta.samples, own=False)  # from anywhere: no wakes to count on
    if last_event_id:
        await reader.resume_after(_event_id(last_event_id))
    return EventStream(sse(reader, replay_event))


def _event_id(value: str) -> str:
    """``ms-seq`` (``.k``) as Redis takes it: ASCII digits (``isdigit`` also passes '²'), each of the
    entry id's parts a uint64."""
    match = ENTRY_ID.fullmatch(value.strip())
    if match is None or any(int(part or 0) > UINT64_MAX for part in match.groups()[:2]):
        raise bad_request(f"Last-Event-ID {value[:64]!r} is not a stream event id", param="Last-Event-ID")
    ms, seq, k = match.groups()
    return f"{int(ms)}-{int(seq or 0)}" + (f".{int(k)}" if k is not None else "")
