"""Scheduling fields at the edge: ``priority`` on every route (a clear 400 when bad, nothing
written), the tenant (the API key's, else OpenAI's ``user``), and the queue position in
``GET /v1/requests/{id}`` once a router has ordered the request."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from pydantic import SecretStr

from producer.app import create_app
from producer.edge.auth import hash_key, key_tenants
from router.order.ordering import Tagger
from shared import ingress
from shared.codec import from_entry
from shared.keys import Keys
from shared.schemas import GenerateRequest
from tests.redis_keys import keys_with_prefix

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def queued(rclient, keys: Keys) -> list[GenerateRequest]:
    return [from_entry(GenerateRequest, fields) for _, fields in ingress.entries(rclient, keys)]  # every class


async def through_worker(client, worker, route: str, body: dict, headers: dict | None = None) -> GenerateRequest:
    """The request a route enqueued (a fake worker answers it, so routes that wait return)."""
    task = asyncio.create_task(client.post(route, json=body, headers=headers or {}))
    request = await worker.take()
    await worker.generate(request, ["x"], finish_reason="stop")
    assert (await task).status_code in (200, 202)
    return request


async def test_priority_and_default_tenant_on_the_native_routes(client, rclient, keys):
    response = await client.post("/v1/requests", json={"inputs": "hi", "parameters": {"priority": -3}})
    assert response.status_code == 202, response.text
    await client.post("/v1/requests", json={"inputs": "hi"})
    assert [(r.priority, r.tenant) for r in queued(rclient, keys)] == [(-3, "default"), (0, "default")]


@pytest.mark.parametrize("route,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
async def test_openai_priority_and_user_as_tenant_without_keys(client, worker, route, body):
    request = await through_worker(client, worker, route, {**body, "priority": 2, "user": "alice"})
    assert (request.priority, request.tenant) == (2, "alice")
    request = await through_worker(client, worker, route, {**body, "user": " "})
    assert (request.priority, request.tenant) == (0, "default")


BAD = [
    ("/v1/requests", {"inputs": "hi", "parameters": {"priority": "high"}}, "parameters.priority"),
    ("/v1/requests", {"inputs": "hi", "parameters": {"priority": 1.5}}, "parameters.priority"),
    ("/generate", {"inputs": "hi", "parameters": {"priority": 101}}, "parameters.priority"),
    ("/generate", {"inputs": "hi", "parameters": {"priority": True}}, "parameters.priority"),
    ("/v1/chat/completions", {**CHAT, "priority": -101}, "priority"),
    ("/v1/completions", {**COMPLETION, "priority": "1"}, "priority"),
    ("/v1/completions", {**COMPLETION, "user": "u" * 129}, "user"),
    # A terminal escape (and a title change) in lightq top, a line break, a bidi override (red team 3).
    ("/v1/completions", {**COMPLETION, "user": "\u001b[41mEVIL\u001b]0;pwned\u0007"}, "user"),
    ("/v1/chat/completions", {**CHAT, "user": "a\nb"}, "user"),
    ("/v1/chat/completions", {**CHAT, "user": "abc\u202edef"}, "user"),
]


@pytest.mark.parametrize("route,body,param", BAD)
async def test_bad_priority_or_user_is_a_400_naming_it(client, rclient, redis_settings, route, body, param):
    response = await client.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert keys_with_prefix(rclient, redis_settings.key_prefix) == []


def test_keys_name_their_tenants():
    tenants = key_tenants(SecretStr(" team-a:sk-a1 , team-a:sk-a2, sk-b ,, :sk-c"))
    assert tenants[hash_key("sk-a1")] == tenants[hash_key("sk-a2")] == "team-a"
    assert tenants[hash_key("sk-b")] == f"key-{hash_key('sk-b')[:8]}"  # its own, never the key itself
    assert tenants[hash_key("sk-c")] == f"key-{hash_key('sk-c')[:8]}"
    assert len(tenants) == 4


async def test_with_keys_the_key_decides_the_tenant_not_user(settings, tokenizer, rclient, keys):
    app = create_app(settings.model_copy(update={"api_keys": SecretStr("team-a:sk-a,sk-b")}), tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as c:
            for key in ("sk-a", "sk-b"):
                body = {"inputs": "hi", "parameters": {"priority": 1}}
                response = await c.post("/v1/requests", json=body, headers={"Authorization": f"Bearer {key}"})
                assert response.status_code == 202, response.text
            # The /v1/requests body has no user; a chat body's user is ignored with keys (see enqueue).
    assert [(r.priority, r.tenant) for r in queued(rclient, keys)] == [
        (1, "team-a"),
        (1, f"key-{hash_key('sk-b')[:8]}"),
    ]


async def test_status_shows_class_and_position_once_a_router_ordered_it(client, rclient, keys):
    ids = []
    for priority in (1, 0, 1):
        response = await client.post("/v1/requests", json={"inputs": "hi", "parameters": {"priority": priority}})
        ids.append(response.json()["id"])
    view = (await client.get(f"/v1/requests/{ids[0]}")).json()
    assert (view["priority"], view["queue_position"]) == (None, None)  # in the stream, no router read it yet
    Tagger(rclient, keys, {}).tags(queued(rclient, keys))  # what a router does as it reads
    places = [(await client.get(f"/v1/requests/{i}")).json() for i in ids]
    assert [(v["priority"], v["queue_position"]) for v in places] == [(1, 1), (0, 0), (1, 2)]


def test_estimated_wait_is_the_position_over_the_pools_drain_rate():
    from types import SimpleNamespace

    from producer.api.routes_requests import estimated_wait

    services = SimpleNamespace(metrics=SimpleNamespace(snapshot=SimpleNamespace(drain_rate=4.0)))
    assert estimated_wait(services, 3) == 1.0  # three ahead and itself, four a second
    assert estimated_wait(services, None) is None
    services.metrics.snapshot = SimpleNamespace(drain_rate=0.0)  # nothing dispatched lately: no guess
    assert estimated_wait(services, 3) is None
