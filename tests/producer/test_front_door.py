"""The front door (issue 14, item 5): with keys, every path but /health needs one
(the dashboard, its data, the OpenAPI pages and, unless --metrics_open, /metrics);
POST bodies must be JSON; CORS is closed unless --allowed_origins; wrong keys
are throttled per client address."""

from __future__ import annotations

import base64
import contextlib

import httpx
import pytest
from pydantic import SecretStr

from producer.app import create_app
from producer.edge.front_door import FailedAttempts

KEY = "sk-front-door-0123456789"
BODY = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
GUARDED = ["/dashboard", "/dashboard/data", "/openapi.json", "/docs", "/redoc", "/metrics", "/v1/models"]


@contextlib.asynccontextmanager
async def serving(settings, tokenizer, address: str = "10.0.0.1", **update):
    app = create_app(settings.model_copy(update=update), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app, client=(address, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://producer") as client:
            yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"me:{password}".encode()).decode()}


async def test_with_keys_every_page_but_health_needs_one(settings, tokenizer):
    """(The operator's pages, /metrics and the dashboard, take an admin key: ``test_auth``.)"""
    async with serving(settings, tokenizer, admin_api_keys=SecretStr(KEY)) as client:
        assert (await client.get("/health")).status_code == 200
        for path in GUARDED:
            response = await client.get(path)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"
            # (/dashboard/data may be 503 until the first cluster view is read: past the door all the same)
            assert (await client.get(path, headers=bearer(KEY))).status_code in (200, 503), path
        # Browsers: the pages ask for the key (HTTP Basic, key as password) and send it with their fetches.
        assert (await client.get("/dashboard")).headers["WWW-Authenticate"].startswith("Basic")
        assert (await client.get("/v1/models")).headers["WWW-Authenticate"] == "Bearer"
        assert (await client.get("/dashboard/data", headers=basic(KEY))).status_code in (200, 503)
        assert (await client.get("/docs", headers=basic("wrong"))).status_code == 401


async def test_metrics_open_leaves_only_metrics_open(settings, tokenizer):
    async with serving(settings, tokenizer, api_keys=SecretStr(KEY), metrics_open=True) as client:
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/dashboard/data")).status_code == 401


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx"],
)
async def test_a_post_body_that_is_not_json_is_415(settings, tokenizer, rclient, redis_settings, content_type):
    headers = {"content-type": content_type} if content_type else {}
    async with serving(settings, tokenizer) as client:
        for path in ["/generate", "/generate_stream", "/v1/requests", "/v1/completions", "/v1/batches"]:
            response = await client.post(path, content=b'{"inputs": "hello"}', headers=headers)
            assert response.status_code == 415, (path, response.text)
            error = response.json()["error"]
            assert error["code"] == "unsupported_media_type" and error["param"] == "Content-Type"
    assert list(rclient.scan_iter(match=f"{redis_settings.key_prefix}:*")) == []  # nothing was queued


async def test_json_bodies_pass(settings, tokenizer, worker):
    async with serving(settings, tokenizer) as client:
        response = await client.post(
            "/v1/requests", content=b'{"inputs": "hi"}', headers={"content-type": "application/json; charset=utf-8"}
        )
        assert response.status_code == 202
        # Batch files are JSON Lines; a bad one is refused by its checks (400), not by its type.
        response = await client.post("/v1/batches", content=b"{}\n", headers={"content-type": "application/jsonl"})
        assert response.status_code == 400


async def test_cors_is_closed_unless_origins_are_allowed(settings, tokenizer):
    preflight = {
        "Origin": "https://ok.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    async with serving(settings, tokenizer) as client:
        response = await client.options("/generate", headers=preflight)
        assert "access-control-allow-origin" not in response.headers
        response = await client.get("/health", headers={"Origin": "https://ok.example"})
        assert "access-control-allow-origin" not in response.headers
    async with serving(settings, tokenizer, allowed_origins="https://ok.example", api_keys=SecretStr(KEY)) as client:
        response = await client.options("/generate", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://ok.example"
        response = await client.options("/generate", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in response.headers
        response = await client.get("/v1/models", headers={"Origin": "https://ok.example", **bearer(KEY)})
        assert response.headers["access-control-allow-origin"] == "https://ok.example"


async def test_wrong_keys_are_throttled_per_address(settings, tokenizer):
    async with serving(settings, tokenizer, api_keys=SecretStr(KEY), max_auth_failures=10) as client:
        for _ in range(5):  # a missing key is no guess: it never counts (a browser's first page load)
            assert (await client.get("/v1/models")).status_code == 401
        for _ in range(10):
            assert (await client.get("/v1/models", headers=bearer("sk-guess"))).status_code == 401
        response = await client.get("/v1/models", headers=bearer(KEY))  # even the right key waits now
        assert response.status_code == 429
        assert response.json()["error"]["code"] == "auth_throttled" and int(response.headers["Retry-After"]) >= 1
    async with serving(settings, tokenizer, "10.0.0.2", api_keys=SecretStr(KEY)) as other:
        assert (await other.get("/v1/models", headers=bearer(KEY))).status_code == 200


def test_failed_attempts_clear_after_their_window():
    now = [0.0]
    attempts = FailedAttempts(limit=3, window_s=10.0, clock=lambda: now[0])
    for _ in range(3):
        attempts.record("a")
        now[0] += 1.0
    assert attempts.retry_after("a") == pytest.approx(7.0) and attempts.retry_after("b") == 0
    now[0] = 10.5  # the first failure left the window
    assert attempts.retry_after("a") == 0
    assert FailedAttempts(limit=0, window_s=1.0).retry_after("a") == 0  # 0: no limit
