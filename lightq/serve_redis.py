"""The Redis of ``lightq serve``: its own embedded one unless a URL is given.

Without ``--redis_url`` / ``LIGHTQ_REDIS_URL``, serve starts an embedded
redis-server on a free port, so two servers on one host never share a
pool by accident. It runs with append-only persistence in ``--data_dir``
(default ``~/.cache/lightq/redis/port-<port>``: a later serve on the same
port finds the queue where this one left it, on the same Redis port), in a process group of its
own, is restarted if it dies (same port, same data) and is stopped last.
A lock file in the data directory, held by serve and by the redis-server
(an inherited descriptor), keeps a second server off the same files.

With a URL that answers, serve joins that pool and says what already
serves it; a local URL that does not answer gets an embedded server on
its port (data in a temporary directory unless ``--data_dir`` is given).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import urlparse

import redis

from router.workers.registry import read_registry
from shared.config import RedisSettings
from shared.embedded_redis import EmbeddedRedis, free_port, start_embedded_redis
from shared.keys import Keys
from shared.redis import answers, is_cluster, sync_client

log = logging.getLogger("lightq.serve")

PORT_FILE = "redis.port"
LOG_COMPACT_MIN_BYTES = 32 << 20  # a smaller log is replayed in moments: left as it is


@dataclass
class ServeRedis:
    url: str
    embedded: EmbeddedRedis | None = None
    lock: TextIO | None = None  # open while serve runs: the data directory's lock
    temporary: bool = False  # remove the data directory on stop

    def keep_alive(self) -> None:
        """Start the embedded server again if it died (same port, same data directory)."""
        if self.embedded is not None and not self.embedded.alive():
            log.warning("the embedded Redis exited with %s: starting it again", self.embedded.process.returncode)
            self.embedded.restart()

    def stop(self) -> None:
        if self.embedded is not None:
            self.embedded.stop(keep_data=not self.temporary)
        if self.lock is not None:
            self.lock.close()


def explicit_url(flags: dict[str, Any]) -> str | None:
    """The Redis URL the user gave (flag or environment), if any."""
    return flags.get("redis_url") or os.environ.get("LIGHTQ_REDIS_URL") or None


def default_data_dir(port: int) -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "lightq", "redis", f"port-{port}")


def running_serves() -> dict[str, str]:
    """URL of each embedded Redis a running ``lightq serve`` holds in the default place, by its
    data directory: ``lightq top`` and ``lightq dead-letters`` find serve's Redis through it.
    A data directory whose lock can be taken has no serve (the lock is released at once)."""
    root = os.path.dirname(default_data_dir(0))
    found: dict[str, str] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        data_dir = os.path.join(root, name)
        try:
            port = int(open(os.path.join(data_dir, PORT_FILE)).read())
            with open(os.path.join(data_dir, "serve.lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: no serve holds it
        except BlockingIOError:
            found[data_dir] = f"redis://127.0.0.1:{port}/0"
        except (OSError, ValueError):
            continue
    return found


def find_serve_url(flags: dict[str, Any]) -> str | None:
    """The URL a monitoring command should read: the one given, else the one running serve's
    embedded Redis (None: the settings' default). Several running serves: SystemExit naming them."""
    url = explicit_url(flags)
    if url is not None:
        return url
    serves = running_serves()
    if len(serves) > 1:
        listed = "\n  ".join(f"--redis_url {u}   ({d})" for d, u in serves.items())
        raise SystemExit(f"lightq: {len(serves)} lightq serve are running; pick one:\n  {listed}")
    return next(iter(serves.values()), None)


def open_redis(flags: dict[str, Any], data_dir: str, http_port: int) -> ServeRedis:
    """The Redis this serve uses (see the module's doc); SystemExit with one line when there is none."""
    url = explicit_url(flags)
    if url is None:
        return embedded(None, data_dir or default_data_dir(http_port), temporary=False)
    if answers(url):
        log_pool(url, flags.get("redis_key_prefix") or RedisSettings().key_prefix)
        return ServeRedis(url)
    if is_cluster(url):
        raise SystemExit(f"lightq: no Redis Cluster node answers at {url}")
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost") or not parsed.port:
        raise SystemExit(f"lightq: no Redis answers at {url}")
    server = embedded(parsed.port, data_dir or tempfile.mkdtemp(prefix="lightq-redis-"), temporary=not data_dir)
    log.info("no Redis answers at %s: started an embedded one there", url)
    return server


def embedded(port: int | None, data_dir: str, temporary: bool) -> ServeRedis:
    os.makedirs(data_dir, exist_ok=True)
    lock = open(os.path.join(data_dir, "serve.lock"), "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise SystemExit(
            f"lightq: another lightq serve (or its redis-server) uses {data_dir}: give this one --data_dir of its own"
        ) from None
    server = start_embedded_redis(
        port or saved_port(data_dir),
        appendonly=True,
        workdir=data_dir,
        appendfsync="everysec",
        pass_fds=(lock.fileno(),),
        with_parent=True,  # a SIGKILLed serve takes its Redis with it (started and restarted on serve's main thread)
    )
    with open(os.path.join(data_dir, PORT_FILE), "w") as out:
        out.write(str(server.port))
    log.info("embedded Redis at %s (append-only, data in %s)", server.url, data_dir)
    compact_log(server.url)
    return ServeRedis(server.url, server, lock, temporary)


def compact_log(url: str) -> bool:
    """Rewrite the append-only log (in the background) when it holds far more than the data: Redis
    measures its own rewrite rule from the size at start, so a serve that writes less than the file
    already holds never rewrote it, and each restart started larger (a red team's soak: 2 MB to 94 MB
    over five restarts, 1% of it live). True when a rewrite was started."""
    client = redis.Redis.from_url(url)
    try:
        log_bytes = int(client.info("persistence").get("aof_current_size", 0))
        data_bytes = int(client.info("memory")["used_memory"])
        if log_bytes < max(LOG_COMPACT_MIN_BYTES, 4 * data_bytes):
            return False
        client.bgrewriteaof()
        log.info("the append-only log is %d MB for %d MB of data: rewriting it", log_bytes >> 20, data_bytes >> 20)
        return True
    finally:
        client.close()


def saved_port(data_dir: str) -> int:
    """The port this data directory's server had, if it is free, else a free one.

    The same port each time: what Redis keeps names its URL (rq's scheduled housekeeping and
    batch jobs carry their settings), and a later serve must be reachable where they point."""
    try:
        port = int(open(os.path.join(data_dir, PORT_FILE)).read())
    except (OSError, ValueError):
        return free_port()
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return free_port()
    return port


def log_pool(url: str, prefix: str) -> None:
    """Joining a pool: say what it already serves (its live workers), or that it is empty."""
    client = sync_client(RedisSettings(url=url))
    try:
        live = read_registry(client, Keys(prefix)).live
    finally:
        client.close()
    if not live:
        log.info("using Redis at %s (key prefix %s): no live workers there yet", url, prefix)
        return
    served = sorted({str(getattr(load, "model", None) or "?") for load in live.values()})
    log.warning(
        "joining the pool at %s (key prefix %s): %d live worker(s) already serve it (%s; models: %s)",
        url,
        prefix,
        len(live),
        ", ".join(sorted(live)),
        ", ".join(served),
    )
