"""Producer fixtures: one tokenizer per session, an app per test on the test's
own Redis prefix (lifespan run by hand: ASGITransport does not run it)."""

from __future__ import annotations

import httpx
import pytest

from producer.app import create_app
from shared.config import ModelSettings
from shared.keys import Keys
from shared.producer_settings import ProducerSettings
from shared.redis import async_client
from tests.producer.fake_worker import FakeWorker, serving

JSON_HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer  # loaded once a session (tests/conftest.py)


@pytest.fixture
def settings(redis_settings) -> ProducerSettings:
    return ProducerSettings(
        redis=redis_settings,
        model=ModelSettings(max_req_total_len=2048),
        default_max_new_tokens=16,
        stream_block_ms=100,
    )


@pytest.fixture
async def app(settings, tokenizer):
    app = create_app(settings, tokenizer=tokenizer)
    async with app.router.lifespan_context(app):
        yield app


@pytest.fixture
async def client(app):
    # Bodies sent as raw bytes say they are JSON, as real clients do (producer.edge.front_door: 415 otherwise).
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://producer", timeout=30, headers=JSON_HEADERS
    ) as c:
        yield c


@pytest.fixture
async def aredis(redis_settings):
    client = async_client(redis_settings)
    yield client
    await client.aclose()


@pytest.fixture
def worker(aredis, redis_settings) -> FakeWorker:
    return FakeWorker(aredis, Keys(redis_settings.key_prefix))


@pytest.fixture
async def server_url(settings, tokenizer):
    async with serving(settings, tokenizer) as url:
        yield url


@pytest.fixture
async def oai(server_url):
    """The official client, pointed at the producer (only the base URL changes)."""
    openai = pytest.importorskip("openai")
    async with openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client
