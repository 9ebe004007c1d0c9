"""Batch files in OpenAI's batch format, and a batch's status record.

A file is JSONL, one request a line: ``{"custom_id", "method": "POST", "url",
"body"}`` with ``url`` one of ``URLS``. Every line is checked before anything
is queued (``validate_lines``), by the same preparation the HTTP route of its
``url`` runs (``prepare_line``): parsing, model, parameters, tokenisation and
the length limit. An answer becomes an output line in OpenAI's batch output
format (``output_line``): ``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``, the body being what the route answers.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer.api.api_types import ErrorBody, GenerateBody, dump_without_empty_error
from producer.api.errors import ApiError, bad_request, from_validation
from producer.api.openai_render import Call, response
from producer.api.openai_types import ChatCompletionRequest, CompletionRequest
from producer.api.routes_native import failed, generate_result
from producer.api.routes_openai import prepare_chat, prepare_completion
from producer.api.structured import failure
from producer.api.submit import prepare
from producer.api.vocabulary import Vocabulary
from producer.deps import Services
from shared.chunk_schemas import TokenChunk
from shared.schemas import GenerateRequest

URLS = ("/v1/completions", "/v1/chat/completions", "/generate")
Url = Literal["/v1/completions", "/v1/chat/completions", "/generate"]


class BatchLine(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    custom_id: str = Field(min_length=1, max_length=512)
    method: Literal["POST"]
    url: Url
    body: dict[str, Any]


@dataclass(frozen=True)
class Prepared:
    """A line ready to enqueue; ``render(request_id, chunks)`` is the route's answer body (or ApiError)."""

    request: GenerateRequest
    render: Callable[[str, list[TokenChunk]], dict]


def parse_lines(text: str, max_requests: int) -> list[BatchLine]:
    """The file's requests (blank lines skipped); a 400 naming the first bad line."""
    lines: list[BatchLine] = []
    first_use: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        line = _parse_line(raw, number)
        if line.custom_id in first_use:
            raise _line_error(
                number,
                f"custom_id {line.custom_id!r} is already used on line {first_use[line.custom_id]}",
                "duplicate_custom_id",
            )
        first_use[line.custom_id] = number
        lines.append(line)
        if len(lines) > max_requests:
            raise bad_request(
                f"the file has more than {max_requests} requests", code="too_many_requests", reason="invalid_batch"
            )
    if not lines:
        raise bad_request(
            "the file has no requests (one JSON object a line)", code="empty_file", reason="invalid_batch"
        )
    return lines


def line_numbers(text: str) -> list[int]:
    """The file line of each request, in order (for messages that name the line)."""
    return [n for n, raw in enumerate(text.splitlines(), start=1) if raw.strip()]


def _parse_line(raw: str, number: int) -> BatchLine:
    try:
        return BatchLine.model_validate_json(raw)
    except ValidationError as exc:
        problem = from_validation(exc.errors(include_url=False))
        raise _line_error(number, str(problem).replace("request body", "the line", 1), problem.detail.code) from None


def _line_error(number: int, message: str, code: str | None) -> ApiError:
    return bad_request(f"line {number}: {message}", param=f"line {number}", code=code, reason="invalid_batch")


async def validate_lines(lines: list[BatchLine], numbers: list[int], services: Services) -> None:
    """Prepare every line as its route would (nothing is written); a 400 naming the first that fails.
    A line's checks may never await (a token-id prompt: ~1.7 ms of CPU), so each line yields to the
    event loop first: 50,000 lines held the producer's every client for minutes (red team 5)."""
    for line, number in zip(lines, numbers):
        await asyncio.sleep(0)
        try:
            await prepare_line(line, services)
        except ApiError as exc:
            raise _line_error(number, f"{line.url} (custom_id {line.custom_id!r}): {exc}", exc.detail.code) from None


async def prepare_line(line: BatchLine, services: Services) -> Prepared:
    """What the route of ``line.url`` does before it enqueues: the same checks, the same request."""
    raw = json.dumps(line.body)
    if line.url == "/generate":
        body = _parse_body(GenerateBody, raw)
        request = await prepare(body, services)
        render = functools.partial(_render_native, request.num_prompt_tokens, body.params.return_details, request.n)
        return Prepared(request, render)
    if line.url == "/v1/completions":
        completion = _parse_body(CompletionRequest, raw)
        _no_stream(completion.stream)
        request, call = await prepare_completion(completion, services)
    else:
        chat = _parse_body(ChatCompletionRequest, raw)
        _no_stream(chat.stream)
        request, call = await prepare_chat(chat, services)
    return Prepared(request, functools.partial(_render_openai, call, services.vocabulary))


def _parse_body(model: type[BaseModel], raw: str) -> Any:
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation(exc.errors(include_url=False)) from None


def _no_stream(stream: bool) -> None:
    if stream:
        raise bad_request("stream: a batch collects whole answers; leave stream unset", param="stream")


def _render_native(prompt_tokens: int, details: bool, n: int, request_id: str, chunks: list[TokenChunk]) -> dict:
    result = generate_result(chunks, prompt_tokens, details, n)
    if failed(result):  # what /generate answers then
        raise failure(result.error)
    return json.loads(dump_without_empty_error(result))


def _render_openai(call: Call, vocab: Vocabulary, request_id: str, chunks: list[TokenChunk]) -> dict:
    kind = call.id.split("-", 1)[0]  # "cmpl" or "chatcmpl": the id names the request actually followed
    return response(replace(call, id=f"{kind}-{request_id}"), chunks, vocab).model_dump(mode="json")


def error_body(exc: ApiError) -> dict:
    return ErrorBody(error=exc.detail).model_dump(mode="json")


def output_line(
    custom_id: str, request_id: str | None, status_code: int | None, body: dict | None, error: dict | None = None
) -> str:
    """One line of the output file; ``response`` is None when the request was never sent."""
    answer = None if status_code is None else {"status_code": status_code, "request_id": request_id, "body": body}
    return json.dumps(
        {
            "id": f"batch_req_{request_id or uuid.uuid4().hex}",
            "custom_id": custom_id,
            "response": answer,
            "error": error,
        },
        ensure_ascii=False,
    )


# ---- the batch's record: P:{b:ID}:batch ----


class BatchStatus(str, Enum):
    QUEUED = "queued"  # validated, waiting for an rq worker
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.CANCELLED)


class BatchRecord(BaseModel):
    """The batch's status hash; times are Unix seconds, as in OpenAI's batch object."""

    model_config = ConfigDict(extra="ignore")

    status: BatchStatus
    endpoint: str
    total: int
    completed: int = 0
    failed: int = 0
    created_at: int
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None  # set by a cancel request; the job then stops sending
    cancelled_at: int | None = None
    error: str | None = None
    key_hash: str | None = None  # the submitting API key's hash (None: keys are off); only it sees the batch

    @staticmethod
    def fields(**values: Any) -> dict[str, str]:
        """Hash fields for HSET: enums by value, None dropped."""
        for name in values:
            if name not in BatchRecord.model_fields:
                raise KeyError(f"unknown batch field {name}")
        return {
            name: value.value if isinstance(value, Enum) else str(value)
            for name, value in values.items()
            if value is not None
        }


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def endpoint_of(lines: list[BatchLine]) -> str:
    """The one url every line uses, or ``mixed`` (lightq accepts several in one file)."""
    urls = {line.url for line in lines}
    return urls.pop() if len(urls) == 1 else "mixed"
