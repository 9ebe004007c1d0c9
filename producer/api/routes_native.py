"""LightLLM's native routes (``/generate``, ``/generate_stream``), ``/health`` and ``/metrics``.

Both generate routes validate and enqueue before answering anything, then
follow the request's chunk stream; a client that leaves cancels its request.
"""

from __future__ import annotations

import asyncio
import functools
import os

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisClusterException, RedisError

from producer.api.api_types import (
    BODY_DOC,
    GenerateResult,
    PromptTokenDetail,
    TokenDetail,
    dump_without_empty_error,
    special_ids,
    stream_event,
)
from producer.api.errors import bad_request
from producer.api.params import check_group
from producer.api.structured import failure
from producer.api.submit import abandon, submit
from producer.deps import GenerateBodyDep, ServicesDep
from producer.edge.auth import CallerDep
from producer.streams.responses import EventStream, collect, sse, unanswered
from producer.streams.streaming import follower
from shared.chunk_schemas import TokenChunk

router = APIRouter()
HEALTH_TIMEOUT_S = 2.0
PID_HEADER = "X-Lightq-Pid"  # which of the --producers processes answered


@router.post("/generate", response_model=GenerateResult, openapi_extra=BODY_DOC)
async def generate(request: Request, body: GenerateBodyDep, services: ServicesDep, caller: CallerDep) -> Response:
    queued = await submit(body, "generate", services, caller.key_hash)
    chunks = await collect(
        follower(services, queued.id, queued.n),
        request.is_disconnected,
        functools.partial(abandon, services, queued.id),
    )
    if chunks is None:
        return unanswered([queued.id])  # the client left (499), or this producer is stopping (503)
    result = generate_result(chunks, queued.num_prompt_tokens, body.params.return_details, queued.n)
    if queued.params.prompt_logprobs is not None:
        result = result.model_copy(update={"prompt_logprobs": prompt_details(queued.prompt_ids, chunks)})
    if failed(result):  # 400 for the client's to change (a constraint, too large), 404 adapter gone, else 500
        raise failure(result.error)
    # The id its status stays under (GET /v1/requests/{id}: where it ran, its timings), as streams say it
    headers = {"X-Request-Id": queued.id}
    return Response(dump_without_empty_error(result), media_type="application/json", headers=headers)


def failed(result: GenerateResult) -> bool:
    """Whether a sample ended in an error (then /generate answers 500, as it always did)."""
    reasons = result.finish_reason if isinstance(result.finish_reason, list) else [result.finish_reason]
    return "error" in reasons


def generate_result(chunks: list[TokenChunk], prompt_tokens: int, details: bool = False, n: int = 1) -> GenerateResult:
    """LightLLM's answer: text per sample; counts, reasons and details scalar for n=1, per sample above."""
    if n == 1:  # one pass less for the common case
        tokens, last = [[c for c in chunks if c.token_id is not None]], [chunks[-1]]
    else:
        tokens = [[c for c in chunks if c.choice == i and c.token_id is not None] for i in range(n)]
        last = [[c for c in chunks if c.choice == i][-1] for i in range(n)]
    detail = (
        [[TokenDetail(id=c.token_id, text=c.text, logprob=c.logprob) for c in own] for own in tokens] if details else []
    )

    def shaped(values: list):
        return values[0] if n == 1 else values

    return GenerateResult(
        generated_text=["".join(c.text for c in own) for own in tokens],
        count_output_tokens=shaped([len(own) for own in tokens]),
        finish_reason=shaped([c.finish_reason for c in last]),
        prompt_tokens=prompt_tokens,
        tokens=shaped(detail) if details else None,
        error=next((c.error for c in last if c.error), None),
    )


def prompt_details(prompt_ids: list[int], chunks: list[TokenChunk]) -> list[PromptTokenDetail] | None:
    """Each prompt token's logprob and alternatives (the worker sends them with the first token)."""
    scored = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    if scored is None:  # the request ended without a token (an error is reported instead)
        return None
    first = PromptTokenDetail(id=prompt_ids[0], logprob=None)
    rest = [PromptTokenDetail(id=i, logprob=lp, top_logprobs=top) for i, (lp, top) in zip(prompt_ids[1:], scored)]
    return [first, *rest]


@router.post("/generate_stream", openapi_extra=BODY_DOC, response_class=EventStream)
async def generate_stream(
    request: Request, body: GenerateBodyDep, services: ServicesDep, caller: CallerDep
) -> EventStream:
    if check_group(body.params.n, body.params.best_of, "parameters.") > 1:  # LightLLM's rule too
        raise bad_request(
            "parameters.best_of must be 1 on /generate_stream (its events have no sample "
            "index): use /generate, or /v1/completions with stream and n",
            param="parameters.best_of",
        )
    queued = await submit(body, "generate_stream", services, caller.key_hash)
    special = special_ids(services.tokenizer)  # LightLLM's "special" flag of each token event
    scored = queued.params.prompt_logprobs is not None  # sent with the first event (dropped before)

    def event(_entry_id, chunk: TokenChunk) -> str:
        details = prompt_details(queued.prompt_ids, [chunk]) if scored and chunk.prompt_logprobs is not None else None
        return stream_event(chunk, queued.num_prompt_tokens, special, details)

    events = sse(
        follower(services, queued.id),
        event,
        disconnected=request.is_disconnected,
        on_abandon=functools.partial(abandon, services, queued.id),
    )
    return EventStream(events, request_id=queued.id)


@router.get("/health", responses={503: {"description": "Redis does not answer"}})
@router.get("/healthz", include_in_schema=False)
async def health(services: ServicesDep) -> JSONResponse:
    try:
        healthy = bool(await asyncio.wait_for(services.redis.ping(), HEALTH_TIMEOUT_S))
    except (RedisError, RedisClusterException, OSError, asyncio.TimeoutError):
        healthy = False
    headers = {PID_HEADER: str(os.getpid())}
    if healthy:
        return JSONResponse({"message": "Ok"}, headers=headers)
    return JSONResponse({"message": "Error"}, status_code=503, headers=headers)


@router.get("/metrics", response_class=Response)
async def metrics(services: ServicesDep) -> Response:
    """Counters and histograms as they are, the cluster gauges of the last refresh: no Redis here."""
    return Response(services.metrics.render(), media_type=CONTENT_TYPE_LATEST, headers={PID_HEADER: str(os.getpid())})
