"""Every error this service answers, in OpenAI's shape, and the handlers that
make sure no validation problem turns into a 500.

Refusals a client should retry (429, 503) carry ``Retry-After`` (seconds) and
``X-Lightq-Reject-Reason`` (the same machine-readable reason as ``error.code``).
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import RedisClusterException, RedisError
from starlette.exceptions import HTTPException

from producer.api.api_types import ErrorBody, ErrorDetail

log = logging.getLogger(__name__)
REJECT_REASON_HEADER = "X-Lightq-Reject-Reason"
REDIS_RETRY_AFTER_S = 1  # a restarting Redis is usually back within seconds


class ApiError(Exception):
    """An error answer; ``reason`` (when set) is counted as a rejected request."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        reason: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=kind, param=param, code=code)
        self.reason = reason
        self.headers = headers


def bad_request(
    message: str, *, param: str | None = None, code: str | None = None, reason: str = "invalid_request"
) -> ApiError:
    return ApiError(400, message, param=param, code=code, reason=reason)


def not_found(request_id: str) -> ApiError:
    return ApiError(404, f"no request {request_id}", param="id", code="not_found", kind="not_found_error")


def retry_later(status: int, message: str, code: str, retry_after_s: float, kind: str = "server_error") -> ApiError:
    """A 429 or 503 the client should retry: ``code`` doubles as the rejection reason."""
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_s))), REJECT_REASON_HEADER: code}
    return ApiError(status, message, code=code, kind=kind, reason=code, headers=headers)


def from_validation(errors: list[dict], *, reason: str = "invalid_request") -> ApiError:
    """A 400 naming the first problem pydantic found (``parameters.top_p: ...``)."""
    if not errors:
        return bad_request("invalid request", reason=reason)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return bad_request(f"request body is not valid JSON: {detail}", code="json_invalid", reason="invalid_json")
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_union_tag(part)]
    param = ".".join(loc) or None
    message = f"{param or 'request body'}: {first.get('msg')}"
    return bad_request(message, param=param, code=first.get("type"), reason=reason)


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union it tried (``stop.str``, ``prompt.list[int]``): not a field."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "dict"})


def error_response(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorBody(error=detail).model_dump(mode="json"), status_code=status, headers=headers)


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    metrics = getattr(request.app.state, "metrics", None)
    if exc.reason is not None and metrics is not None:
        metrics.rejected.labels(reason=exc.reason).inc()
    return error_response(exc.status, exc.detail, exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await _api_error(request, from_validation(list(exc.errors())))


async def _pydantic_error(request: Request, exc: ValidationError) -> JSONResponse:
    return await _api_error(request, from_validation(exc.errors(include_url=False)))


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    detail = ErrorDetail(message=str(exc.detail), type=kind, code=str(exc.status_code))
    return error_response(exc.status_code, detail, exc.headers)


async def _redis_down(request: Request, exc: RedisError | RedisClusterException) -> JSONResponse:
    # Timeouts on the producer's client (producer.redis_client) make an unreachable Redis end
    # here within seconds; the pool reconnects on the next command once Redis is back.
    # Not counted as a rejection: it may be a status poll, or a request already queued.
    log.warning("Redis error on %s %s: %s", request.method, request.url.path, exc)
    error = retry_later(503, "request queue unavailable, retry later", "redis_unavailable", REDIS_RETRY_AFTER_S)
    return error_response(error.status, error.detail, error.headers)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, ErrorDetail(message="internal error", type="server_error"))


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ValidationError, _pydantic_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RedisError, _redis_down)
    # A cluster client that reaches no node (a producer host cut off) raises RedisClusterException,
    # which is no RedisError: without this, a 500 (tests/integration/test_host_faults.py saw one).
    app.add_exception_handler(RedisClusterException, _redis_down)
    app.add_exception_handler(Exception, _unexpected)
