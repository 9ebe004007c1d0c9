"""``lightq serve``: the whole pool on one machine, as child processes.

Redis: the one at ``--redis_url`` when it answers, else an embedded
redis-server started here and stopped on exit. Then ``--workers N`` workers,
one router and the producer, each a separate process configured through
``LIGHTQ_*`` environment variables. Ctrl-C or SIGTERM stops every child
(SIGTERM, then SIGKILL after a grace period); a child that dies on its own
brings the rest down too, so a broken pool never looks alive.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from shared.config import RedisSettings
from shared.embedded_redis import EmbeddedRedis, start_embedded_redis
from shared.redis import answers
from lightq.flags import as_env

log = logging.getLogger("lightq.serve")

GRACE_S = 10.0


def spawn(role: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lightq.cli", role], env=env)


def start_redis(url: str) -> tuple[str, EmbeddedRedis | None]:
    if answers(url):
        log.info("using Redis at %s", url)
        return url, None
    server = start_embedded_redis()
    log.info("no Redis answers at %s: started an embedded one at %s", url, server.url)
    return server.url, server


def serve(flags: dict[str, Any], num_workers: int) -> int:
    url, embedded = start_redis(flags.get("redis_url") or RedisSettings().url)
    env = {**os.environ, **as_env(flags), "LIGHTQ_REDIS_URL": url}
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children: list[tuple[str, subprocess.Popen]] = []
    try:
        children += [("worker", spawn("worker", env)) for _ in range(num_workers)]
        children += [("router", spawn("router", env)), ("producer", spawn("producer", env))]
        return watch(children, stop)
    finally:
        stop_all(children)
        if embedded is not None:
            embedded.stop()


def watch(children: list[tuple[str, subprocess.Popen]], stop: threading.Event) -> int:
    while not stop.wait(0.5):
        for role, child in children:
            if child.poll() is not None:
                log.error("%s (pid %d) exited with %d: stopping the pool", role, child.pid, child.returncode)
                return child.returncode or 1
    return 0


def stop_all(children: list[tuple[str, subprocess.Popen]]) -> None:
    for _, child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for role, child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM: killing it", role, child.pid)
            child.kill()
            child.wait()
