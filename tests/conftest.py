"""Shared fixtures: a real Redis (the local one, or an embedded one) with a
key prefix of its own per test, removed afterwards."""

from __future__ import annotations

import os
import uuid

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU interpreter; this must precede any triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import redis

from shared.config import RedisSettings
from shared.embedded_redis import start_embedded_redis
from shared.keys import Keys
from shared.redis import answers

LOCAL_URL = os.environ.get("LIGHTQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url():
    """The local Redis when one answers, else an embedded one for the session."""
    if answers(LOCAL_URL):
        yield LOCAL_URL
        return
    server = start_embedded_redis()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_settings(redis_url) -> RedisSettings:
    prefix = f"lightq-test-{uuid.uuid4().hex[:10]}"
    settings = RedisSettings(url=redis_url, key_prefix=prefix)
    yield settings
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def keys(redis_settings) -> Keys:
    return Keys(redis_settings.key_prefix)


@pytest.fixture
def rclient(redis_settings):
    client = redis.Redis.from_url(redis_settings.url, decode_responses=True)
    yield client
    client.close()


def keys_with_prefix(client: redis.Redis, prefix: str) -> list[str]:
    """Every key under a test's prefix: for 'leaves no trace' checks."""
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
