"""A burst's pooled Redis connections are closed once idle (``producer.redis_client.trim_idle``):
redis-py's pool never closes one, and 2,600 clients dropped at once left a producer holding ~2,000
(34 MB of Redis memory; at four producers, 8,000 of Redis's default 10,000 clients). A real Redis,
the producer's own client."""

from __future__ import annotations

import asyncio

from producer.redis_client import producer_client, trim_idle


def connections_named(rclient, name: str) -> int:
    return sum(1 for c in rclient.client_list() if c.get("name") == name)


async def test_a_bursts_idle_connections_are_closed_and_the_client_serves_on(settings, rclient):
    client = producer_client(settings)
    name = f"trim-{settings.redis.key_prefix}"
    client.connection_pool.connection_kwargs["client_name"] = name
    try:
        # 40 commands in flight at once: 40 connections, idle in the pool after them.
        await asyncio.gather(*(client.blpop([f"{settings.redis.key_prefix}:nothing"], timeout=0.2) for _ in range(40)))
        assert connections_named(rclient, name) == 40
        assert await trim_idle(client, keep=5) == 35
        assert connections_named(rclient, name) == 5
        assert await trim_idle(client, keep=5) == 0
        assert await client.ping()  # served by a kept one
        await asyncio.gather(*(client.blpop([f"{settings.redis.key_prefix}:nothing"], timeout=0.1) for _ in range(10)))
        assert connections_named(rclient, name) == 10  # the pool grows again as it must
    finally:
        await client.aclose()
