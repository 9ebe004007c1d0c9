"""The producer's front door: ASGI middleware around every route, FastAPI's own
``/openapi.json``, ``/docs`` and ``/redoc`` included (route dependencies miss those).

- ``KeyGuard``: with ``--api_keys``, no path but the open ones (``auth.open_paths``)
  without a valid key; wrong keys are counted per client address and past
  ``--max_auth_failures`` in ``--auth_failure_window_s`` the address gets 429,
  except for keys that already worked from that address (``KnownKeys``).
- ``JsonOnly``: a POST that carries a body must say it is JSON (415 otherwise), so a
  web page cannot queue work with a form post or a ``text/plain`` fetch, which
  browsers send cross-origin without asking the server first.
- CORS: closed (no ``Access-Control-Allow-*`` answer) unless ``--allowed_origins``;
  then Starlette's ``CORSMiddleware`` answers preflights and marks responses.

The failure counter lives in this process, not in Redis: a guess costs no Redis
write (an unauthenticated client cannot make Redis work, and an outage does not
turn 401s into 503s), at the price of each producer replica counting on its own
(N replicas allow N times the guesses: still 10^-30 odds against a 128-bit key).
Behind a proxy the client address is the proxy's unless ``--forwarded_allow_ips``
names the proxy (``producer.main``: uvicorn's proxy-headers middleware, for
those addresses only, rewrites the client address from ``X-Forwarded-For``).

Throttle the guesses, not the owner. A throttled address still gets in with a
key that already worked from it before (the owner behind a NAT, or behind an
unnamed proxy that an attacker shares): they are remembered per address. Any
other key from a throttled address, right or wrong, gets the same 429 without
being checked, so the throttle still tells a guesser nothing about its guesses.
"""

from __future__ import annotations

import base64
import binascii
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from producer.api.errors import REJECT_REASON_HEADER, ApiError, error_response, retry_later
from producer.edge.auth import (
    SCOPE_KEY,
    admin_only,
    admin_refusal,
    hash_key,
    key_hashes,
    open_paths,
    unauthorized,
)
from shared.producer_settings import ProducerSettings

BROWSER_PAGES = ("/dashboard", "/docs", "/redoc")  # their 401 asks the browser for the key (HTTP Basic)
JSON_TYPES = frozenset({"application/json"})
JSONL_TYPES = frozenset(
    {"application/jsonl", "application/x-ndjson", "application/json-lines", "application/x-jsonlines"}
)
JSONL_PATHS = ("/v1/batches",)  # batch files are JSON Lines
MAX_ADDRESSES = 10_000  # addresses with recent failures kept; past it, stale ones are dropped
MAX_KNOWN = 10_000  # (address, key) pairs that worked, kept; past it, the least recently used go


class FailedAttempts:
    """Wrong-key attempts per client address within a sliding window."""

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._times: dict[str, deque[float]] = {}

    def _recent(self, address: str, now: float) -> deque[float]:
        times = self._times.get(address, deque())
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return times

    def retry_after(self, address: str) -> float:
        """Seconds until ``address`` may try again (0: it may now)."""
        if not self.limit:
            return 0.0
        now = self.clock()
        times = self._recent(address, now)
        return times[0] + self.window_s - now if len(times) >= self.limit else 0.0

    def record(self, address: str) -> None:
        if not self.limit:
            return
        now = self.clock()
        if len(self._times) >= MAX_ADDRESSES:  # bounded memory under a spray of addresses
            self._times = {a: t for a, t in self._times.items() if self._recent(a, now)}
        times = self._recent(address, now)
        times.append(now)
        self._times[address] = times


class KnownKeys:
    """The (client address, key hash) pairs that authenticated, least recently used first."""

    def __init__(self, limit: int = MAX_KNOWN) -> None:
        self.limit = limit
        self._pairs: OrderedDict[tuple[str, str], None] = OrderedDict()

    def add(self, address: str, key_hash: str) -> None:
        self._pairs[(address, key_hash)] = None
        self._pairs.move_to_end((address, key_hash))
        if len(self._pairs) > self.limit:
            self._pairs.popitem(last=False)

    def __contains__(self, pair: tuple[str, str]) -> bool:
        return pair in self._pairs


def presented_key(headers: dict[bytes, bytes]) -> str | None:
    """The key from ``Authorization``: Bearer KEY, or Basic with the key as password (browsers)."""
    scheme, _, value = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if scheme.lower() == "basic":
        try:
            _, _, password = base64.b64decode(value.strip(), validate=True).decode("utf-8").partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return password or None
    return None


async def _answer(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    """An error answered before the app runs, counted as a rejection like the app's own."""
    metrics = getattr(getattr(scope.get("app"), "state", None), "metrics", None)
    if metrics is not None and error.reason is not None:
        metrics.rejected.labels(reason=error.reason).inc()
    await error_response(error.status, error.detail, error.headers)(scope, receive, send)


class KeyGuard:
    def __init__(
        self,
        app: ASGIApp,
        hashes: frozenset[str],
        open_: frozenset[str],
        failures: FailedAttempts,
        known: KnownKeys,
        admins: frozenset[str] = frozenset(),
    ) -> None:
        self.app, self.hashes, self.open, self.failures, self.known = app, hashes, open_, failures, known
        self.admins = admins  # the keys (hashed, among ``hashes``) the operator's routes take

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.hashes or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        address = (scope.get("client") or ("unknown",))[0]
        key = presented_key(dict(scope["headers"]))
        key_hash = hash_key(key) if key is not None else None
        wait_s = self.failures.retry_after(address)
        if key_hash in self.hashes and (not wait_s or (address, key_hash) in self.known):
            self.known.add(address, key_hash)
            if admin_only(scope["path"]) and key_hash not in self.admins:
                await _answer(scope, receive, send, admin_refusal())  # a right key: not a guess
                return
            scope[SCOPE_KEY] = key_hash
            await self.app(scope, receive, send)
            return
        if wait_s:  # any other key: the same answer, right or wrong
            await _answer(
                scope,
                receive,
                send,
                retry_later(
                    429,
                    "too many failed API key attempts from this address",
                    "auth_throttled",
                    wait_s,
                    kind="rate_limit_error",
                ),
            )
            return
        if key is not None:  # a wrong key is a guess; a missing one (a first page load) is not
            self.failures.record(address)
        error = unauthorized(
            "an API key is required: send 'Authorization: Bearer KEY'" if key is None else "the API key is not valid"
        )
        if scope["path"].startswith(BROWSER_PAGES):
            error.headers = {"WWW-Authenticate": 'Basic realm="lightq", charset="UTF-8"'}
        await _answer(scope, receive, send, error)


def media_type(headers: dict[bytes, bytes]) -> str:
    return headers.get(b"content-type", b"").decode("latin-1").partition(";")[0].strip().lower()


def has_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0").strip() not in (b"0", b"") or b"transfer-encoding" in headers


class JsonOnly:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"]) if scope["type"] == "http" else {}
        if scope["type"] != "http" or scope["method"] != "POST" or not has_body(headers):
            await self.app(scope, receive, send)
            return
        kind = media_type(headers)
        allowed = JSON_TYPES | (JSONL_TYPES if scope["path"].startswith(JSONL_PATHS) else frozenset())
        if kind in allowed or kind.endswith("+json"):
            await self.app(scope, receive, send)
            return
        await _answer(
            scope,
            receive,
            send,
            ApiError(
                415,
                f"request body must be JSON: send 'Content-Type: application/json' (got {kind or 'none'!r})",
                param="Content-Type",
                code="unsupported_media_type",
                reason="unsupported_media_type",
            ),
        )


def origins(allowed_origins: str) -> list[str]:
    return [origin.strip() for origin in allowed_origins.split(",") if origin.strip()]


def install(app: FastAPI, settings: ProducerSettings) -> None:
    """Add the front door around the app (outermost last: CORS, then keys, then JSON bodies)."""
    app.add_middleware(JsonOnly)
    app.add_middleware(
        KeyGuard,
        hashes=key_hashes(settings.api_keys, settings.admin_api_keys),
        open_=open_paths(settings.metrics_open),
        admins=key_hashes(settings.admin_api_keys),
        failures=FailedAttempts(settings.max_auth_failures, settings.auth_failure_window_s),
        known=KnownKeys(),
    )
    if origins(settings.allowed_origins):
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins(settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "Retry-After", REJECT_REASON_HEADER],
        )
