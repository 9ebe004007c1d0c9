"""LightLLM's native routes (``/generate``, ``/generate_stream``), ``/health`` and ``/metrics``.

Both generate routes validate and enqueue before answering anything, then
follow the request's chunk stream; a client that leaves cancels its request.
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from producer.api_types import BODY_DOC, GenerateResult, TokenDetail, dump_without_empty_error
from producer.auth import CallerDep
from producer.deps import GenerateBodyDep, ServicesDep
from producer.errors import ApiError
from producer.streaming import EventStream, collect, follower, native_event, sse
from producer.submit import abandon, submit
from shared.schemas import TokenChunk

router = APIRouter()
HEALTH_TIMEOUT_S = 2.0


@router.post("/generate", response_model=GenerateResult, openapi_extra=BODY_DOC)
async def generate(request: Request, body: GenerateBodyDep, services: ServicesDep, caller: CallerDep) -> Response:
    queued = await submit(body, "generate", services, caller.key_hash)
    chunks = await collect(follower(services, queued.id), request.is_disconnected,
                           functools.partial(abandon, services, queued.id))
    if chunks is None:
        return Response(status_code=499)  # nobody is listening any more
    result = generate_result(chunks, queued.num_prompt_tokens, body.params.return_details)
    if result.finish_reason == "error":
        raise ApiError(500, result.error or "generation failed", code="generation_failed", kind="server_error")
    return Response(dump_without_empty_error(result), media_type="application/json")


def generate_result(chunks: list[TokenChunk], prompt_tokens: int, details: bool = False) -> GenerateResult:
    tokens = [chunk for chunk in chunks if chunk.token_id is not None]
    last = chunks[-1]
    return GenerateResult(
        generated_text=["".join(chunk.text for chunk in tokens)],
        count_output_tokens=len(tokens),
        finish_reason=last.finish_reason,
        prompt_tokens=prompt_tokens,
        tokens=[TokenDetail(id=c.token_id, text=c.text, logprob=c.logprob) for c in tokens] if details else None,
        error=last.error,
    )


@router.post("/generate_stream", openapi_extra=BODY_DOC, response_class=EventStream)
async def generate_stream(request: Request, body: GenerateBodyDep, services: ServicesDep,
                          caller: CallerDep) -> EventStream:
    queued = await submit(body, "generate_stream", services, caller.key_hash)
    events = sse(
        follower(services, queued.id),
        lambda _entry_id, chunk: native_event(chunk, queued.num_prompt_tokens),
        disconnected=request.is_disconnected,
        on_abandon=functools.partial(abandon, services, queued.id),
    )
    return EventStream(events)


@router.get("/health", responses={503: {"description": "Redis does not answer"}})
@router.get("/healthz", include_in_schema=False)
async def health(services: ServicesDep) -> JSONResponse:
    try:
        healthy = bool(await asyncio.wait_for(services.redis.ping(), HEALTH_TIMEOUT_S))
    except (RedisError, OSError, asyncio.TimeoutError):
        healthy = False
    if healthy:
        return JSONResponse({"message": "Ok"})
    return JSONResponse({"message": "Error"}, status_code=503)


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    body = await services.metrics.render(services.redis, services.keys)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
