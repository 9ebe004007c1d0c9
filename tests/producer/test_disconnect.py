"""Through a real uvicorn server: a client that leaves /generate or
/generate_stream cancels its request (ASGITransport cannot disconnect)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from producer import main as producer_main
from shared.schemas import RequestStatus
from tests.producer.fake_worker import serving


async def test_stream_disconnect_cancels(settings, tokenizer, worker):
    async with serving(settings, tokenizer) as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/generate_stream", json={"inputs": "hello"}) as response:
            request = await worker.take()
            await worker.token(request.id, 0, "Hi")
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data:{")
        # the connection is closed here, before the request finished
        assert await worker.wait_cancel(request.id)
        await worker.end(request.id, 1, RequestStatus.CANCELLED, "cancelled")
        metrics = (await client.get("/metrics")).text
        assert "lightq:client_disconnects_total 1.0" in metrics


async def test_generate_disconnect_cancels(settings, tokenizer, worker):
    async with serving(settings, tokenizer) as url, httpx.AsyncClient(base_url=url, timeout=0.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/generate", json={"inputs": "hello"})
        request = await worker.take()  # queued, never served: the client gave up
        assert await worker.wait_cancel(request.id)


async def test_finished_stream_does_not_cancel(settings, tokenizer, worker, aredis, keys):
    async with serving(settings, tokenizer) as url, httpx.AsyncClient(base_url=url) as client:
        task = asyncio.create_task(client.post("/generate_stream", json={"inputs": "hello"}))
        request = await worker.take()
        await worker.generate(request, ["a", "b"])
        assert (await task).text.count("data:") == 2
        await asyncio.sleep(0.2)
        assert not await aredis.exists(keys.cancel(request.id))


def test_main_builds_settings_from_flags(monkeypatch):
    seen = []
    monkeypatch.setattr(producer_main, "run", seen.append)
    monkeypatch.setenv("LIGHTQ_DEFAULT_MAX_NEW_TOKENS", "32")
    producer_main.main(["--port", "9123", "--redis_url", "redis://example:6380/1", "--max_req_total_len", "4096"])
    (settings,) = seen
    assert settings.port == 9123 and settings.redis.url == "redis://example:6380/1"
    assert settings.model.max_req_total_len == 4096 and settings.default_max_new_tokens == 32
