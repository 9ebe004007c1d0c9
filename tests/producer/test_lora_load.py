"""LoRA adapters loaded and unloaded at run time, the producer's side (issue 32): vLLM's
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` check what they can without the model
(a 4xx writes nothing), record the change in the model's Redis registry, and answer by what the
live workers' load records say (200 / 202 / 422); requests, /v1/models and the 404 follow the
registry; the routes need an API key as every route does."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import SecretStr

from producer.app import create_app
from shared.codec import decode, encode
from shared.config import ModelSettings
from shared.lora import LoraRegistry
from shared.producer_settings import ProducerSettings
from shared.request_log import now_ms
from shared.worker_load import WorkerLoad
from tests.producer.conftest import JSON_HEADERS
from tests.producer.test_lora_select import BASE, queued

STATIC = "sql=/nowhere/sql"  # a --lora_modules adapter: the producer never reads its files


def make_folder(root, name: str, **config) -> str:
    """A PEFT-shaped folder (the producer reads only the config; the weights file need only exist)."""
    folder = root / name
    folder.mkdir()
    base = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps({**base, **config}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return str(folder)


@pytest.fixture
def lora_settings(redis_settings) -> ProducerSettings:
    model = ModelSettings(lora_modules=[STATIC], max_lora_rank=16)
    return ProducerSettings(redis=redis_settings, model=model, lora_wait_s=0.0, stream_block_ms=100)


async def open_client(settings: ProducerSettings, tokenizer, headers=None):
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://p", headers={**JSON_HEADERS, **(headers or {})}
        ) as client:
            yield client


@pytest.fixture
async def lora_client(lora_settings, tokenizer):
    async for client in open_client(lora_settings, tokenizer):
        yield client


async def registry(aredis, keys) -> LoraRegistry | None:
    raw = await aredis.get(keys.lora_registry(BASE))
    return None if raw is None else decode(LoraRegistry, raw)


async def live_worker(aredis, keys, worker_id: str, **fields) -> None:
    """A live worker's load record, as a worker's heartbeat writes it."""
    load = WorkerLoad(
        worker_id=worker_id, seq=1, ts_ms=now_ms(), max_total_tokens=1000, used_tokens=0, committed_tokens=0,
        num_running=0, num_waiting=0, requests=[], model=BASE, **fields,
    )  # fmt: skip
    await aredis.zadd(keys.workers(), {worker_id: now_ms()})
    await aredis.set(keys.load(worker_id), encode(load))


async def test_a_load_is_recorded_and_followed_by_requests_and_models(lora_client, aredis, keys, tmp_path):
    folder = make_folder(tmp_path, "poems")
    reply = await lora_client.post("/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": folder})
    assert reply.status_code == 202, reply.text  # no live worker lists it yet (--lora_wait_s 0)
    assert reply.json() == {"lora_name": "poems", "status": "recorded", "workers": []}
    assert await registry(aredis, keys) == LoraRegistry(version=1, adapters={"poems": folder})
    cards = (await lora_client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(BASE, None), ("sql", BASE), ("poems", BASE)]
    again = await lora_client.post("/v1/load_lora_adapter", json={"lora_name": "poems", "lora_path": folder})
    assert again.status_code == 400 and again.json()["error"]["code"] == "lora_exists"
    submit = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "adapter": "poems"}}
    assert (await lora_client.post("/v1/requests", json=submit)).status_code == 202
    chat = {"model": "poems", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for path, body in [
        ("/v1/completions", {"model": "poems", "prompt": "Hi", "max_tokens": 2}),
        ("/v1/chat/completions", chat),
    ]:
        with pytest.raises(TimeoutError):  # queued; no worker answers, and the client gives up waiting
            await asyncio.wait_for(lora_client.post(path, json=body), 2.0)
    static = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "adapter": "sql"}}
    assert (await lora_client.post("/v1/requests", json=static)).status_code == 202
    # a run-time adapter's requests carry its folder: unloaded while one runs, it goes where the request goes
    got = [(r.adapter, r.adapter_path) for r in await queued(aredis, keys)]
    assert got == [("poems", folder)] * 3 + [("sql", None)]

    reply = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "poems"})
    assert reply.status_code == 200 and reply.json()["status"] == "unloaded"  # no live worker lists it
    assert await registry(aredis, keys) is None  # an empty registry leaves no key
    assert (await lora_client.post("/v1/requests", json=submit)).status_code == 404
    reply = await lora_client.post("/v1/completions", json={"model": "poems", "prompt": "Hi"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    assert [c["id"] for c in (await lora_client.get("/v1/models")).json()["data"]] == [BASE, "sql"]


async def test_the_answer_follows_the_live_workers(lora_settings, tokenizer, aredis, keys, tmp_path):
    settings = lora_settings.model_copy(update={"lora_wait_s": 60.0})  # answered by the records, not the clock
    good, bad = make_folder(tmp_path, "good"), make_folder(tmp_path, "bad")
    await live_worker(aredis, keys, "w1", adapters=["good"])
    await live_worker(aredis, keys, "w2", lora_failed=[("bad", bad, "shapes do not fit")])
    async for client in open_client(settings, tokenizer):
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": good})
        assert reply.status_code == 200 and reply.json() == {"lora_name": "good", "status": "loaded", "workers": ["w1"]}
        await live_worker(aredis, keys, "w1", lora_failed=[("bad", bad, "shapes do not fit")])
        reply = await client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": bad})
        assert reply.status_code == 422, reply.text
        assert "shapes do not fit" in reply.json()["error"]["message"]
        assert (await registry(aredis, keys)).adapters == {"good": good}  # the failed one taken back
        await live_worker(aredis, keys, "w1", adapters=["good"])  # still listed: the unload waits, then 202
    short = settings.model_copy(update={"lora_wait_s": 0.0})
    async for client in open_client(short, tokenizer):
        reply = await client.post("/v1/unload_lora_adapter", json={"lora_name": "good"})
        assert reply.status_code == 202
        assert reply.json() == {"lora_name": "good", "status": "recorded", "workers": ["w1"]}
    assert await registry(aredis, keys) is None


@pytest.mark.parametrize(
    "name, folder, config, message",
    [
        ("bad name!", "ok", {}, "lora_name 'bad name!'"),
        (BASE, "ok", {}, "is the model's or a --lora_modules adapter's"),
        ("sql", "ok", {}, "is the model's or a --lora_modules adapter's"),
        ("x", None, {}, "is not a folder"),
        ("x", "ok", {"use_dora": True}, "DoRA is not supported"),
        ("x", "ok", {"r": 32}, "rank 32 is over --max_lora_rank 16"),
        ("x", "ok", {"target_modules": ["q_proj", "embed_tokens"]}, "target modules ['embed_tokens']"),
        ("x", "ok", {"peft_type": "PREFIX_TUNING"}, "not LORA"),
        # Each of these once went through to every worker, which died reading it, at every restart.
        ("x", "ok", {"lora_alpha": "abc"}, "lora_alpha 'abc' is not a finite number"),
        ("x", "ok", {"lora_alpha": None}, "lora_alpha None is not a finite number"),
        ("x", "ok", {"lora_alpha": True}, "lora_alpha True is not a finite number"),
        ("x", "ok", {"lora_alpha": float("inf")}, "lora_alpha inf is not a finite number"),
        ("x", "ok", {"use_rslora": "yes"}, "use_rslora 'yes' is not true or false"),
    ],
)
async def test_bad_input_is_a_400_that_writes_nothing(
    lora_client, aredis, keys, tmp_path, name, folder, config, message
):  # noqa: E501
    path = make_folder(tmp_path, "ok", **config) if folder else str(tmp_path / "missing")
    reply = await lora_client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert await registry(aredis, keys) is None


async def test_unloading_what_is_not_loaded(lora_client, aredis, keys):
    reply = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    reply = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert reply.status_code == 400 and "--lora_modules" in reply.json()["error"]["message"]
    reply = await lora_client.post("/v1/unload_lora_adapter", json={"lora_name": "x", "extra": 1})
    assert reply.status_code == 400
    assert await registry(aredis, keys) is None


async def test_the_routes_need_an_admin_key(lora_settings, tokenizer, aredis, keys, tmp_path):
    """No key: 401; a key that is not the operator's: 403 (loading changes the whole pool); an
    admin key: done."""
    keyed = lora_settings.model_copy(update={"api_keys": SecretStr("sk-user"), "admin_api_keys": SecretStr("sk-lora")})
    body = {"lora_name": "poems", "lora_path": make_folder(tmp_path, "poems")}
    routes = [("/v1/load_lora_adapter", body), ("/v1/unload_lora_adapter", {"lora_name": "poems"})]
    for headers, status in [({}, 401), ({"Authorization": "Bearer sk-user"}, 403)]:
        async for client in open_client(keyed, tokenizer, headers):
            for path, sent in routes:
                assert (await client.post(path, json=sent)).status_code == status
        assert await registry(aredis, keys) is None
    async for client in open_client(keyed, tokenizer, {"Authorization": "Bearer sk-lora"}):
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 202
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "poems"})).status_code == 200
