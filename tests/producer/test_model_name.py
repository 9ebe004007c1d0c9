"""Every request a producer queues names the model it serves (``--served_model_name``, else the
model's file or folder name), which routers match against the workers' records."""

from __future__ import annotations

import httpx
import pytest

from producer.app import create_app
from shared.codec import from_entry
from shared.config import ModelSettings
from shared.producer_settings import ProducerSettings
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.producer.conftest import JSON_HEADERS
from worker.engine.engine import LoadSnapshot
from worker.engine.load import build_load
from worker.service.serve import WorkerService


@pytest.mark.parametrize("name", ["", "my-model"])
async def test_queued_requests_carry_the_served_model_name(redis_settings, tokenizer, aredis, keys, name):
    settings = ProducerSettings(redis=redis_settings, model=ModelSettings(served_model_name=name))
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://p", headers=JSON_HEADERS
        ) as client:
            reply = await client.post("/v1/requests", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
            assert reply.status_code == 202
            models = (await client.get("/v1/models")).json()["data"]
    entries = await aredis.xrange(keys.requests())
    queued = [from_entry(GenerateRequest, fields) for _, fields in entries]
    expected = name or "SmolLM2-135M-Instruct.Q4_1"  # the embedded GGUF's file name
    assert [r.model for r in queued] == [expected]
    assert [m["id"] for m in models] == [expected]


def test_a_worker_publishes_the_model_it_serves(redis_settings):
    settings = WorkerSettings(redis=redis_settings, model=ModelSettings(model_dir="counting", served_model_name="m1"))
    service = WorkerService(settings, None, _Idle(), "w1", publisher=None)
    assert service.load(1).model == "m1"
    assert service.load(1).adapters == []
    with_lora = settings.model.model_copy(update={"lora_modules": ["sql=/a", "poems=/b"]})
    service = WorkerService(settings.model_copy(update={"model": with_lora}), None, _Idle(), "w1", publisher=None)
    load = service.load(2)
    assert load.adapters == ["sql", "poems"]
    assert load.serves("m1", "sql") and not load.serves("m1", "other") and load.serves("m1")
    # a message naming an adapter the worker lacks (a mismatched pool) is refused, never started
    msg = GenerateRequest(id="r", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=2), created_ms=0)
    assert service._refusal(msg.model_copy(update={"adapter": "sql"})) is None
    assert "'other' is not served" in service._refusal(msg.model_copy(update={"adapter": "other"}))
    assert build_load(_Idle(), "w2", 1, "0-0").model is None  # a record without a name takes any request


class _Idle:
    """An engine with nothing running (what ``build_load`` reads)."""

    num_preempted = num_preempted_tokens = 0

    class limits:
        max_total_tokens, running_max_req_size = 100, 8

    @staticmethod
    def snapshot():
        return LoadSnapshot(0, 0, 0, 0)

    @staticmethod
    def requests():
        return []
