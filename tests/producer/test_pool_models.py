"""``/v1/models`` lists every model a live worker of the pool serves, from the workers' own records in
Redis (written as their heartbeat writes them), marking the one this producer takes requests for
(issue 33 item 8); the official openai client reads the list."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from producer.app import create_app
from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from tests.producer.conftest import JSON_HEADERS
from tests.producer.fake_worker import serving
from tests.producer.test_model_name import _Idle
from worker.service.heartbeat import Heartbeat
from worker.service.serve import WorkerService

OWN, OTHER = "my-model", "other-model"
WAIT_S = 30  # a bound on waiting for the cluster view to be read, not a measurement


def beat(rclient, redis_settings, worker_id: str, model: str) -> None:
    """One heartbeat of a real worker service serving ``model``: its load record, as workers write it."""
    settings = WorkerSettings(redis=redis_settings, model=ModelSettings(model_dir="counting", served_model_name=model))
    service = WorkerService(settings, None, _Idle(), worker_id, publisher=None)
    Heartbeat(rclient, redis_settings.keys, worker_id, 0.5, service.load).beat()


@pytest.fixture
def producer_settings(settings):
    return settings.model_copy(update={"model": ModelSettings(served_model_name=OWN)})


async def test_models_lists_the_pools_models_and_marks_this_producers(
    producer_settings, tokenizer, rclient, redis_settings
):
    beat(rclient, redis_settings, "wa", OWN)
    beat(rclient, redis_settings, "wb1", OTHER)
    beat(rclient, redis_settings, "wb2", OTHER)
    rclient.zadd(redis_settings.keys.workers(), {"gone": 1})  # a member whose record expired: not live
    app = create_app(producer_settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        await app.state.cluster_view.refresh_now()
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p", headers=JSON_HEADERS) as client:
            models = (await client.get("/v1/models")).json()["data"]
            one = await client.get(f"/v1/models/{OTHER}")
            missing = await client.get("/v1/models/nobody")
            refused = await client.post("/v1/completions", json={"model": OTHER, "prompt": "hi", "max_tokens": 1})
    assert [(m["id"], m["accepted_here"], m["live_workers"]) for m in models] == [(OWN, True, 1), (OTHER, False, 2)]
    assert models[0]["max_model_len"] == 2048 and models[1]["max_model_len"] is None
    assert all(m["object"] == "model" and m["owned_by"] == "lightq" for m in models)
    assert one.status_code == 200 and one.json()["id"] == OTHER and one.json()["accepted_here"] is False
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    # Listed, but this producer cannot tokenise for it: a 404 that says where it is served.
    assert refused.status_code == 404 and "served in this pool" in refused.json()["error"]["message"]


async def test_the_openai_client_lists_the_pool(producer_settings, tokenizer, rclient, redis_settings):
    openai = pytest.importorskip("openai")
    beat(rclient, redis_settings, "wb1", OTHER)
    async with serving(producer_settings.model_copy(update={"metrics_refresh_s": 0.1}), tokenizer) as url:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            deadline = time.monotonic() + WAIT_S
            while len(models := (await client.models.list()).data) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # until the cluster view has read the record
            retrieved = await client.models.retrieve(OTHER)
    assert [m.id for m in models] == [OWN, OTHER]
    assert models[0].live_workers == 0 and models[1].accepted_here is False  # extra fields, kept by the client
    assert retrieved.id == OTHER
