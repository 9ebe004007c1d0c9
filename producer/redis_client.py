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
