"""Optional API keys (``--api_keys`` / ``LIGHTQ_API_KEYS``), per-key rate limits, and
the rest of the front door: JSON-only POST bodies, CORS, throttled key guessing.

With keys configured, every path but ``/health`` (and ``/metrics`` with
``--metrics_open``) needs a key, FastAPI's own ``/openapi.json``, ``/docs``
and ``/redoc`` and the dashboard included (``front_door.KeyGuard``, an ASGI middleware,
so routes FastAPI adds itself are covered too). The key comes as
``Authorization: Bearer KEY`` or, for browsers, HTTP Basic with the key as
password: the HTML pages answer 401 with a Basic challenge, the browser asks
once and sends the same credentials with the page's own requests. Without a
key: 401, OpenAI's ``invalid_api_key``.

A key is known by its SHA-256 (``key_hash``), the only form compared or
stored: a request records its key's hash in its status hash, and another key
asking for it (status, stream, cancel) gets the 404 of an unknown id, so it
cannot even learn that the id exists. Without keys the API is open, as before.

Keys in ``--admin_api_keys`` are keys too, and the only ones that may use the
operator's routes (``ADMIN_PATHS``: adapters loaded for the whole pool, and
``/metrics`` and the dashboard, which name every tenant): any other key gets
403 ``admin_key_required`` there (``front_door.KeyGuard``).

Failed key attempts are counted per client address in this process
(``front_door.FailedAttempts``); past ``--max_auth_failures`` in
``--auth_failure_window_s`` the address gets 429 until its window clears.

``--rate_limit_rpm`` counts each key's POSTs (the routes that create work) per
clock minute in a Redis counter with a TTL, so all producer replicas share
it; past the limit the answer is 429 ``rate_limited`` with ``Retry-After``
set to the seconds left in the minute.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from producer.api.errors import ApiError, retry_later
from producer.deps import Services, get_services
from shared.producer_settings import api_key_entries
from shared.schemas import MAX_TENANT_CHARS

# Liveness probes stay open (they tell nothing but "up"); /metrics only with --metrics_open.
OPEN_PATHS = frozenset({"/health", "/healthz"})
METRICS_PATH = "/metrics"
# The operator's routes (prefixes): with keys on, only --admin_api_keys' keys get in.
ADMIN_PATHS = (METRICS_PATH, "/dashboard", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
SCOPE_KEY = "lightq.key_hash"  # where KeyGuard leaves the verified key's hash in the ASGI scope
WINDOW_S = 60
bearer = HTTPBearer(auto_error=False, description="an API key, when the server was started with --api_keys")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def open_paths(metrics_open: bool) -> frozenset[str]:
    return OPEN_PATHS | {METRICS_PATH} if metrics_open else OPEN_PATHS


def _entries(*key_lists: SecretStr) -> list[tuple[str | None, str]]:
    """``--api_keys`` (and ``--admin_api_keys``) as (tenant, key)
    (``shared.producer_settings.api_key_entries``, which the settings already checked)."""
    return [entry for keys in key_lists for entry in api_key_entries(keys.get_secret_value())]


def key_hashes(*key_lists: SecretStr) -> frozenset[str]:
    """The configured keys, hashed (without their tenants)."""
    return frozenset(hash_key(key) for _, key in _entries(*key_lists))


def key_tenants(*key_lists: SecretStr) -> dict[str, str]:
    """Each key's tenant (router.order.ordering shares tokens fairly between tenants): the one given
    before it, else its own, ``key-`` and the start of its hash (never the key itself)."""
    return {
        hash_key(key): (tenant or f"key-{hash_key(key)[:8]}")[:MAX_TENANT_CHARS] for tenant, key in _entries(*key_lists)
    }


def admin_only(path: str) -> bool:
    return path.startswith(ADMIN_PATHS)


def admin_refusal() -> ApiError:
    return ApiError(
        403,
        "this route is the operator's: it needs a key of --admin_api_keys",
        code="admin_key_required",
        reason="forbidden",
        kind="permission_error",
    )


@dataclass(frozen=True)
class Caller:
    """Who is asking: ``key_hash`` is None when keys are off (or on an open path)."""

    key_hash: str | None = None

    def owns(self, request_key_hash: str | None) -> bool:
        return self.key_hash is None or self.key_hash == request_key_hash


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", reason="unauthorized", headers={"WWW-Authenticate": "Bearer"})


async def authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Caller:
    """The app-wide dependency: who is asking (``KeyGuard`` already checked the key), and 429 past
    the key's rate. Checks the bearer key itself where no ``KeyGuard`` ran (an app without it)."""
    services = get_services(request)
    if not services.api_key_hashes or request.url.path in open_paths(services.settings.metrics_open):
        return Caller()
    key_hash = request.scope.get(SCOPE_KEY)
    if key_hash is None:
        if credentials is None:
            raise unauthorized("an API key is required: send 'Authorization: Bearer KEY'")
        key_hash = hash_key(credentials.credentials)
        if key_hash not in services.api_key_hashes:
            raise unauthorized("the API key is not valid")
    if request.method == "POST":
        await check_rate(services, key_hash)
    return Caller(key_hash)


async def check_rate(services: Services, key_hash: str) -> None:
    limit = services.settings.rate_limit_rpm
    if not limit:
        return
    now = time.time()
    counter = services.keys.rate_limit(key_hash, int(now // WINDOW_S))
    async with services.redis.pipeline(transaction=True) as pipe:
        pipe.incr(counter)
        pipe.expire(counter, 2 * WINDOW_S)  # outlives its minute, then goes by itself
        count, _ = await pipe.execute()
    if count > limit:
        raise retry_later(
            429,
            f"rate limit reached: {limit} requests per minute for this API key",
            "rate_limited",
            WINDOW_S - now % WINDOW_S,
            kind="rate_limit_error",
        )


CallerDep = Annotated[Caller, Depends(authenticate)]
