"""A Redis Cluster client that reaches no node raises ``RedisClusterException`` (redis-py's
``RedisClusterUnreachableError``, ``SlotNotCoveredError``), which is no ``RedisError``: the
producer must answer it as it answers any Redis outage, a 503 the client retries, not a 500
(a producer host cut off from its cluster once answered 500, tests/integration/test_host_faults.py)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from redis.exceptions import ConnectionError, RedisClusterUnreachableError, SlotNotCoveredError

from producer.api.errors import install_handlers


@pytest.mark.parametrize(
    "error",
    [
        RedisClusterUnreachableError("Redis Cluster cannot be connected"),
        SlotNotCoveredError("slot 42 is not covered"),
        ConnectionError("no route to host"),
    ],
    ids=type,
)
async def test_a_cluster_outage_is_a_503_to_retry(error):
    app = FastAPI()
    install_handlers(app)

    @app.post("/generate")
    async def generate():
        raise error

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://producer") as client:
        response = await client.post("/generate", json={})
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "redis_unavailable"
    assert response.headers["Retry-After"] == "1"
