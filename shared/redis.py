"""Redis client factories and the few stream helpers every service shares."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from shared.config import RedisSettings


def async_client(settings: RedisSettings) -> aioredis.Redis:
    """An asyncio client returning str values; the caller closes it (``aclose``).

    Each open stream's blocking XREAD holds a connection, so the pool is sized
    by ``max_connections`` and a request past it waits for one instead of failing.
    """
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        decode_responses=True,
        health_check_interval=30,
        max_connections=settings.max_connections,
        timeout=30,
    )
    return aioredis.Redis(connection_pool=pool)


def sync_client(settings: RedisSettings) -> redis.Redis:
    """A thread-safe blocking client (its pool hands each thread a connection)."""
    return redis.Redis.from_url(settings.url, decode_responses=True, health_check_interval=30)


def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
    """Create a consumer group (and its stream) if missing; idempotent."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def ensure_group_async(client: aioredis.Redis, stream: str, group: str) -> None:
    try:
        await client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def answers(url: str, timeout_s: float = 0.5) -> bool:
    """True if a Redis server answers PING at ``url``."""
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


class Backoff:
    """Exponential backoff with a cap: 0.1 s, 0.2 s, ... up to ``cap_s``."""

    def __init__(self, first_s: float = 0.1, cap_s: float = 5.0):
        self.first_s = first_s
        self.cap_s = cap_s
        self.delay = first_s

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.cap_s, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first_s


def group_backlog(client: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(lag, pending) of a consumer group: entries never delivered, and delivered but not acked.

    Without the group every entry is lag. Redis before 7.0 reports no ``lag``
    (and 7.x cannot after deletions): then count what follows the last delivery.
    """
    if not client.exists(stream):
        return 0, 0
    info = next((g for g in client.xinfo_groups(stream) if g["name"] == group), None)
    if info is None:
        return int(client.xlen(stream)), 0
    lag = info.get("lag")
    if lag is None:
        lag = len(client.xrange(stream, min=f"({info['last-delivered-id']}", count=100_000))
    return int(lag), int(info["pending"])
