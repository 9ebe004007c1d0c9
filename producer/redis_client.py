"""The producer's Redis client: bounded waits, so an outage is a quick 503, never a hang.

``shared.redis.async_client`` sizes the pool; on top of it every connection
gets a connect timeout and a read timeout (``redis_timeout_s``, plus the
longest blocking XREAD for reads), and a command that hits a dead pooled
connection is retried once on a fresh one: after a Redis restart the first
command reconnects instead of failing. The URL is redis-py's: a password or
ACL user (``redis://user:password@host:6379/0``) and TLS (``rediss://``, with
``ssl_cert_reqs``, ``ssl_ca_certs`` ... as query parameters) work as they do
for the router and workers, which parse it with the same ``from_url``.

``with_reconnect`` lets a long reader (a client following its tokens) ride
out a Redis restart: it retries with backoff for ``redis_outage_s``.

A burst of N clients leaves N pooled connections open after it (redis-py's pool
never closes an idle one): 2,000 per producer after 2,600 clients dropped at
once, 8,000 of Redis's default 10,000 clients at four producers. ``trim_idle``,
run every ``IDLE_TRIM_S`` by the app, closes the longest idle past ``KEEP_IDLE``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from shared.producer_settings import ProducerSettings
from shared.redis import OUTAGES, async_client

log = logging.getLogger(__name__)
T = TypeVar("T")
OUTAGE_ERRORS = OUTAGES
FIRST_RETRY_S, MAX_RETRY_S = 0.05, 2.0  # backoff doubles from 0.1 s up to 2 s
IDLE_TRIM_S = 60.0
KEEP_IDLE = 32  # idle connections kept for the next burst


def producer_client(settings: ProducerSettings) -> aioredis.Redis:
    timeouts = {
        "socket_connect_timeout": settings.redis_timeout_s,
        "socket_timeout": settings.redis_timeout_s + settings.stream_block_ms / 1000,
    }
    if settings.redis.cluster:
        # Two retries, the topology read again between them (after a failover the slot map still
        # names the dead primary until then), and a refresh that reaches no node gives up: an
        # unreachable cluster is a 503 in seconds. (The client's defaults, 3 retries and refreshes at
        # most a second apart, took 23 s with this host cut off, then failed.)
        retry = Retry(ExponentialBackoff(cap=0.5, base=0.1), retries=2)
        return async_client(settings.redis, retry=retry, topology_refresh_min_interval=0.2, **timeouts)
    # One retry, on a fresh connection: a command after a Redis restart reconnects instead of failing.
    client = async_client(settings.redis, **timeouts)
    client.set_retry(Retry(ExponentialBackoff(cap=0.1, base=0.02), retries=1))
    return client


async def with_reconnect(action: Callable[[], Awaitable[T]], outage_s: float) -> T:
    """``action()``, retried with backoff while Redis is unreachable, for at most ``outage_s``."""
    give_up = time.monotonic() + outage_s
    delay = FIRST_RETRY_S
    while True:
        try:
            return await action()
        except OUTAGE_ERRORS as exc:
            delay = min(delay * 2, MAX_RETRY_S)
            if time.monotonic() + delay > give_up:
                raise
            log.warning("Redis unreachable (%s): retrying in %.1f s", exc, delay)
            await asyncio.sleep(delay)


async def trim_idle(client: aioredis.Redis, keep: int = KEEP_IDLE) -> int:
    """Close the pool's idle connections past ``keep``, the longest idle first; how many. Taken off
    the pool's list with no await in between, so no task can be handed one meanwhile (the list is
    redis-py's own: a client without one, a cluster's, is left alone and 0 returned)."""
    pool = getattr(client, "connection_pool", None)
    available = getattr(pool, "_available_connections", None)
    if not isinstance(available, list) or len(available) <= keep:
        return 0
    extra = available[: len(available) - keep]  # the pool hands out from the end: these idled longest
    del available[: len(extra)]
    await asyncio.gather(*(connection.disconnect() for connection in extra), return_exceptions=True)
    return len(extra)


async def trim_idle_forever(client: aioredis.Redis, period_s: float = IDLE_TRIM_S) -> None:
    """The app's task: ``trim_idle`` every period, until cancelled."""
    while True:
        await asyncio.sleep(period_s)
        if closed := await trim_idle(client):
            log.info("closed %d idle Redis connections (kept %d)", closed, KEEP_IDLE)
