"""API keys: 401 without one, per-key rate limits, one key cannot see another's requests, and the
operator's routes take only an admin key."""

from __future__ import annotations

import hashlib

import httpx
import pytest
from pydantic import SecretStr

from producer.app import create_app
from producer.edge.auth import key_hashes
from shared.producer_settings import ProducerSettings
from tests.producer.test_priority import queued

KEY_A, KEY_B = "sk-alpha-0123456789", "sk-bravo-9876543210"
ADMIN = "sk-admin-5555555555"
BODY = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def keyed(settings, tokenizer):
    app = create_app(
        settings.model_copy(
            update={
                "api_keys": SecretStr(f" {KEY_A}, ,{KEY_B} "),
                "admin_api_keys": SecretStr(f"ops:{ADMIN}"),
                "rate_limit_rpm": 4,
            }
        ),
        tokenizer=tokenizer,
    )
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
            yield client


@pytest.mark.parametrize("headers", [{}, auth("sk-wrong"), {"Authorization": KEY_A}, {"Authorization": "Basic eDp5"}])
async def test_no_key_or_a_wrong_one_is_401(keyed, rclient, redis_settings, headers):
    for method, path in [
        ("POST", "/generate"),
        ("POST", "/v1/requests"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/requests/" + "a" * 32),
    ]:
        response = await keyed.request(method, path, json=BODY, headers=headers)
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert list(rclient.scan_iter(match=f"{redis_settings.key_prefix}:*")) == []


async def test_probes_stay_open(keyed):
    assert (await keyed.get("/health")).status_code == 200
    assert (await keyed.get("/metrics")).status_code == 401  # a key, unless --metrics_open (test_front_door)
    assert (await keyed.get("/metrics", headers=auth(ADMIN))).status_code == 200


OPERATOR_ROUTES = [
    ("GET", "/metrics", None),
    ("GET", "/dashboard", None),
    ("GET", "/dashboard/data", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
]


@pytest.mark.parametrize(("method", "path", "body"), OPERATOR_ROUTES, ids=[r[1] for r in OPERATOR_ROUTES])
async def test_the_operators_routes_take_only_an_admin_key(keyed, rclient, redis_settings, method, path, body):
    """Before, any key could load or unload adapters for the whole pool, and read every tenant's
    names and counts on /metrics and the dashboard."""
    response = await keyed.request(method, path, json=body, headers=auth(KEY_A))
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "admin_key_required"
    assert list(rclient.scan_iter(match=f"{redis_settings.key_prefix}:*")) == []
    response = await keyed.request(method, path, json=body, headers=auth(ADMIN))
    assert response.status_code not in (401, 403), response.text  # past the door (the route's own answer)


async def test_an_admin_key_is_a_key_and_its_tenant_is_its_own(keyed, rclient, keys):
    submitted = await keyed.post("/v1/requests", json=BODY, headers=auth(ADMIN))
    assert submitted.status_code == 202, submitted.text
    assert [r.tenant for r in queued(rclient, keys)] == ["ops"]


async def test_requests_belong_to_their_key(keyed, worker, aredis, keys):
    submitted = (await keyed.post("/v1/requests", json=BODY, headers=auth(KEY_A))).json()
    request = await worker.take()
    await worker.generate(request, ["x", "y"])
    meta = await aredis.hgetall(keys.meta(submitted["id"]))
    assert meta["key_hash"] == hashlib.sha256(KEY_A.encode()).hexdigest()
    for key in await aredis.keys(f"{keys.prefix}:*"):  # the key itself is written nowhere
        dump = str(await aredis.dump(key))
        assert KEY_A not in dump and "alpha" not in dump
    status_url, stream_url = submitted["status_url"], submitted["stream_url"]
    assert (await keyed.get(status_url, headers=auth(KEY_A))).json()["output_text"] == "xy"
    assert "data:" in (await keyed.get(stream_url, headers=auth(KEY_A))).text
    for method, path in [("GET", status_url), ("GET", stream_url), ("DELETE", status_url)]:
        response = await keyed.request(method, path, headers=auth(KEY_B))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert not await aredis.exists(keys.cancel(submitted["id"]))


async def test_rate_limit_per_key(keyed, rclient, keys):
    for _ in range(4):
        assert (await keyed.post("/v1/requests", json=BODY, headers=auth(KEY_A))).status_code == 202
    response = await keyed.post("/v1/requests", json=BODY, headers=auth(KEY_A))
    assert response.status_code == 429 and response.json()["error"]["code"] == "rate_limited"
    assert response.headers["X-Lightq-Reject-Reason"] == "rate_limited"
    assert 1 <= int(response.headers["Retry-After"]) <= 60
    # Reads are not counted, and another key has its own budget.
    assert (await keyed.get("/v1/models", headers=auth(KEY_A))).status_code == 200
    assert (await keyed.post("/v1/requests", json=BODY, headers=auth(KEY_B))).status_code == 202
    counters = list(rclient.scan_iter(match=f"{keys.prefix}:{{k:*}}:rpm:*"))
    assert len(counters) == 2 and all(0 < rclient.ttl(c) <= 120 for c in counters)


async def test_openai_client_sends_its_key(settings, tokenizer, worker):
    openai = pytest.importorskip("openai")
    from tests.producer.fake_worker import serving

    keyed_settings = settings.model_copy(update={"api_keys": SecretStr(KEY_A)})
    async with serving(keyed_settings, tokenizer) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0) as client:
            async with worker.answering(lambda request: (["ok"], "stop")):
                completion = await client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt="hi")
            assert completion.choices[0].text == "ok"
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                await client.models.list()


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv("LIGHTQ_API_KEYS", f"{KEY_A},{KEY_B}")
    settings = ProducerSettings()
    assert KEY_A not in repr(settings)  # a secret: never in logs
    assert key_hashes(settings.api_keys) == {hashlib.sha256(k.encode()).hexdigest() for k in (KEY_A, KEY_B)}
    assert key_hashes(SecretStr("")) == frozenset()
