"""Redis client factories and the few stream helpers every service shares.

One server (``redis://``) or a Redis Cluster (``redis+cluster://HOST:PORT,HOST:PORT``): the factories
give redis-py's cluster client for the latter, which routes each command by its key's slot and
follows the cluster through failovers. Callers keep every multi-key command, transaction and script
within one slot (``shared.keys``: the control plane ``{q}``, a request group's data plane).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster as rcluster
import redis.exceptions as rexc
from redis._parsers.commands import AsyncCommandsParser
from redis.crc import key_slot

from shared.config import RedisSettings

# What an unreachable, restarting or failing-over Redis raises: callers that ride out an outage
# (a loop's back-off, a 503) catch these. A cluster adds its own: no slot owner yet, a reshard.
OUTAGES: tuple[type[BaseException], ...] = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    rexc.MasterDownError,
    rexc.RedisClusterUnreachableError,  # a cluster client that reached no node (a host cut off)
    OSError,
)
# Any failure of a Redis command, a cluster's own included: redis-py's RedisClusterException family
# (a cluster client that reached no node, a slot with no owner) is no RedisError. What a loop that
# must outlive Redis catches: a worker's heartbeat thread that caught RedisError alone died when a
# whole cluster restarted, and the worker served on without a record, unseen by the routers.
REDIS_FAILURES: tuple[type[BaseException], ...] = (rexc.RedisError, rexc.RedisClusterException)


def stream_keys(args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The keys of an XREAD or XREADGROUP (the first half of what follows STREAMS); None for others."""
    words = [(a.decode() if isinstance(a, bytes) else str(a)).upper() for a in args]
    if words[0] not in ("XREAD", "XREADGROUP") or "STREAMS" not in words:
        return None
    rest = args[words.index("STREAMS") + 1 :]
    return tuple(rest[: len(rest) // 2])


class _Cluster(rcluster.RedisCluster):  # type: ignore[misc]
    """redis-py's cluster client, reading the keys of XREAD and XREADGROUP itself: it asks a node
    (COMMAND GETKEYS, on its default node) for them, and a default node that died with a failed-over
    primary made every read of the router and the workers fail for a minute (seen on a 3+3 cluster)."""

    def _get_command_keys(self, *args: Any) -> Any:
        keys = stream_keys(args)
        return keys if keys is not None else super()._get_command_keys(*args)


class _AsyncParser(AsyncCommandsParser):  # type: ignore[misc]
    async def get_keys(self, *args: Any) -> Any:
        keys = stream_keys(args)
        return keys if keys is not None else await super().get_keys(*args)


class _AsyncCluster(aiocluster.RedisCluster):  # type: ignore[misc]
    """The asyncio client, likewise (its parser asks the node it was first initialised on)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands_parser = _AsyncParser()


def is_cluster(url: str) -> bool:
    return url.split("://", 1)[0].endswith("+cluster")


def cluster_seeds(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The seed nodes of a ``redis+cluster://[user:pass@]HOST:PORT[,HOST:PORT...]`` URL and the
    connection options it names (password, username, TLS)."""
    scheme, rest = url.split("://", 1)
    parts = urlsplit("redis://" + rest)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    options: dict[str, Any] = {"ssl": scheme.startswith("rediss")}
    if userinfo:
        user, _, password = userinfo.partition(":")
        options.update(username=unquote(user) or None, password=unquote(password) or None)
    seeds = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        seeds.append((name.strip("[]") or "127.0.0.1", int(port or 6379)))
    return seeds, options


def async_client(settings: RedisSettings, **connection: Any) -> aioredis.Redis:
    """An asyncio client returning str values; the caller closes it (``aclose``). ``connection``:
    options of every connection (``socket_timeout``, ``socket_connect_timeout``).

    Each open stream's blocking XREAD holds a connection, so the pool is sized
    by ``max_connections`` and a request past it waits for one instead of failing.
    (A cluster client's bound is per node, and a request past it fails.)
    """
    if settings.cluster:
        seeds, options = cluster_seeds(settings.url)
        return _AsyncCluster(
            startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in seeds],
            decode_responses=True,
            max_connections=settings.max_connections,
            health_check_interval=30,
            **options,
            **connection,
        )
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.url,
        decode_responses=True,
        health_check_interval=30,
        max_connections=settings.max_connections,
        timeout=30,
        **connection,
    )
    return aioredis.Redis(connection_pool=pool)


async def node_client(client: aioredis.Redis, key: str) -> aioredis.Redis:
    """A plain client of the cluster node that holds ``key`` now (for what must stay on one
    connection there: a blocking read and the CLIENT UNBLOCK that ends it)."""
    await client.initialize()
    node = client.get_node_from_key(key)
    pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
    return aioredis.Redis(connection_pool=pool)


async def xread_spread(client: aioredis.Redis, streams: dict[str, str]) -> list[Any]:
    """XREAD of many streams without blocking, as one server's reply (``[[key, entries], ...]``): one
    XREAD on one server; on a cluster one per slot, pipelined (a node answers its share)."""
    if not client_is_cluster(client):
        return await client.xread(streams) or []
    by_slot: dict[int, dict[str, str]] = {}
    for key, cursor in streams.items():
        by_slot.setdefault(key_slot(key.encode()), {})[key] = cursor
    async with client.pipeline(transaction=False) as pipe:
        for part in by_slot.values():
            pipe.xread(part)
        replies = await pipe.execute()
    return [item for reply in replies for item in reply or []]


def sync_client(settings: RedisSettings) -> redis.Redis:
    """A thread-safe blocking client (its pool hands each thread a connection)."""
    if settings.cluster:
        seeds, options = cluster_seeds(settings.url)
        return _Cluster(
            startup_nodes=[rcluster.ClusterNode(h, p) for h, p in seeds],
            decode_responses=True,
            health_check_interval=30,
            **options,
        )
    return redis.Redis.from_url(settings.url, decode_responses=True, health_check_interval=30)


def client_is_cluster(client: redis.Redis | aioredis.Redis) -> bool:
    return isinstance(client, (rcluster.RedisCluster, aiocluster.RedisCluster))


def publish_command(client: redis.Redis) -> str:
    """PUBLISH on one server; on a cluster SPUBLISH (sharded pub/sub, Redis 7): a message goes to its
    channel's slot's shard, not to every node."""
    return "SPUBLISH" if client_is_cluster(client) else "PUBLISH"


def primaries(client: redis.Redis) -> list[redis.Redis]:
    """A client per server holding keys: the client itself, or each cluster primary's (for what goes
    per server: SCAN, INFO)."""
    if isinstance(client, rcluster.RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


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
    """True if a Redis server answers PING at ``url`` (a cluster URL: any of its seeds)."""
    if is_cluster(url):
        return any(answers(f"redis://{host}:{port}", timeout_s) for host, port in cluster_seeds(url)[0])
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return False


def wait_until_up(client: redis.Redis, log: logging.Logger, give_up: Callable[[], bool] = lambda: False) -> bool:
    """PING until Redis answers (True), with backoff and a warning per try, or until ``give_up()``
    (False): a process started before its Redis (compose, a host that boots first) waits for it,
    saying why, instead of dying with a connection traceback."""
    backoff = Backoff()
    while True:
        try:
            client.ping()
            return True
        except OUTAGES as exc:
            if give_up():  # asked only after a failure: an answering Redis is always taken
                return False
            log.warning("Redis unreachable (%s): retrying in %.1f s", exc, backoff.delay)
            time.sleep(backoff.next())


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
