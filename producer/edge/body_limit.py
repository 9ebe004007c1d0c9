"""A request body size limit (``--max_body_bytes``): 413 before the body is parsed.

An ASGI middleware, so it covers every route, including ones added later
(paths under a prefix of ``larger`` get that prefix's limit: batch files). A
declared ``Content-Length`` past the limit is refused before a byte is read;
a body without one (chunked) is counted as it arrives and refused as soon as
it passes the limit, so memory never holds more than the limit.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.api.errors import ApiError, error_response


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes", code="request_too_large", reason="too_large")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app, self.max_bytes, self.larger = app, max_bytes, larger or {}

    def limit(self, path: str) -> int:
        return next((size for prefix, size in self.larger.items() if path.startswith(prefix)), self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise too_large(limit)  # inside the app: its ApiError handler answers 413
            return message

        await self.app(scope, limited_receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        error = too_large(limit)
        metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(reason=error.reason).inc()
        # Connection: close, as the unread body cannot be skipped safely on a kept-alive connection.
        response = error_response(error.status, error.detail, {"Connection": "close"})
        await response(scope, receive, send)
