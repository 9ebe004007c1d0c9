"""Choosing a LoRA adapter (issue 32): OpenAI's ``model`` or /generate's ``parameters.adapter`` names
one of --lora_modules; the queued message carries it; an unknown one is a 404 ``model_not_found``
with nothing queued; /v1/models lists each adapter with its ``parent``."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from producer.app import create_app
from shared.codec import from_entry
from shared.config import ModelSettings
from shared.producer_settings import ProducerSettings
from shared.schemas import GenerateRequest
from tests.producer.conftest import JSON_HEADERS

BASE = "SmolLM2-135M-Instruct.Q4_1"  # the embedded GGUF's file name: the served model's id
ADAPTERS = ["sql=/nowhere/sql", "poems=/nowhere/poems"]  # the producer never reads the files


@pytest.fixture
async def lora_client(redis_settings, tokenizer):
    settings = ProducerSettings(redis=redis_settings, model=ModelSettings(lora_modules=ADAPTERS))
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p", headers=JSON_HEADERS) as client:
            yield client


async def queued(aredis, keys) -> list[GenerateRequest]:
    return [from_entry(GenerateRequest, fields) for _, fields in await aredis.xrange(keys.requests())]


async def test_models_list_adapters_with_their_parent(lora_client):
    cards = (await lora_client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE), ("poems", BASE)]
    card = (await lora_client.get("/v1/models/poems")).json()
    assert card["parent"] == BASE and card["accepted_here"]


async def test_each_route_carries_the_adapter(lora_client, aredis, keys):
    submit = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "adapter": "sql"}}
    assert (await lora_client.post("/v1/requests", json=submit)).status_code == 202
    base = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    assert (await lora_client.post("/v1/requests", json=base)).status_code == 202
    for path, body in [
        ("/v1/completions", {"model": "poems", "prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "sql", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ]:
        # no worker answers: the request is queued, then the client gives up waiting for its tokens
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(lora_client.post(path, json=body), 2.0)
    got = [(r.adapter, r.model) for r in await queued(aredis, keys)]
    assert got == [("sql", BASE), (None, BASE), ("poems", BASE), ("sql", BASE)]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/requests", {"inputs": "Hi", "parameters": {"adapter": "nope"}}, "parameters.adapter"),
        ("/generate", {"inputs": "Hi", "parameters": {"adapter": "nope"}}, "parameters.adapter"),
        ("/v1/completions", {"model": "nope", "prompt": "Hi"}, "model"),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "Hi"}]}, "model"),
    ],
)
async def test_an_unknown_adapter_is_a_404_before_anything_is_queued(lora_client, aredis, keys, path, body, param):
    reply = await lora_client.post(path, json=body)
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", param)
    assert await queued(aredis, keys) == []
