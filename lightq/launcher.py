"""``lightq serve``: the whole pool on one machine, as child processes.

Redis: the one at ``--redis_url`` when it answers, else an embedded
redis-server started here and stopped on exit. Then ``--workers N`` workers,
one router and the producer, each a separate process configured through
``LIGHTQ_*`` environment variables. Ctrl-C or SIGTERM stops every child
(SIGTERM, then SIGKILL after a grace period). A child that dies on its own
is replaced, whichever it was: no request lives in a process (the queue,
every request's status and its tokens are in Redis), so a new producer,
router or worker carries on where the dead one stopped. Children dying
over and over (MAX_RESTARTS in all) stop the pool, so a broken pool never
looks alive.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any
from urllib.parse import urlparse

import redis

from router.registry import read_registry
from shared.config import RedisSettings
from shared.keys import Keys
from shared.embedded_redis import EmbeddedRedis, start_embedded_redis
from shared.redis import answers
from shared.flags import as_env

log = logging.getLogger("lightq.serve")

GRACE_S = 10.0
MAX_RESTARTS = 5


Child = tuple[str, dict[str, str], subprocess.Popen]  # role, its environment (kept for a restart), process


def spawn(role: str, env: dict[str, str]) -> Child:
    return role, env, subprocess.Popen([sys.executable, "-m", "lightq.cli", role], env=env)


def visible_gpus(env: dict[str, str]) -> list[str]:
    """The GPU ids this pool may use: ``CUDA_VISIBLE_DEVICES`` if set, else every GPU torch sees."""
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        return [gpu.strip() for gpu in env["CUDA_VISIBLE_DEVICES"].split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_slices(env: dict[str, str], num_workers: int, gpus: list[str]) -> list[str | None]:
    """Each worker's own ``CUDA_VISIBLE_DEVICES``: worker i gets GPUs [i*tp, (i+1)*tp).

    Without this every worker of ``--workers 2`` would load onto cuda:0. None
    (leave the environment alone) without GPUs, or when ``--device`` pins one
    explicitly (``cuda:N``, ``cpu``). Too few GPUs fail here, before anything starts.
    """
    tp = int(env.get("LIGHTQ_TP", "1"))
    if not gpus or env.get("LIGHTQ_DEVICE", "auto") not in ("auto", "cuda"):
        return [None] * num_workers
    if len(gpus) < num_workers * tp:
        raise SystemExit(f"--workers {num_workers} x --tp {tp} needs {num_workers * tp} GPUs; "
                         f"{len(gpus)} visible ({','.join(gpus)})")
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(num_workers)]


def worker_envs(env: dict[str, str], num_workers: int, gpus: list[str]) -> list[dict[str, str]]:
    """One environment per worker: its GPUs, and its share of the CPU threads."""
    envs = []
    for gpu_slice in gpu_slices(env, num_workers, gpus):
        own = worker_env(env, num_workers)
        if gpu_slice is not None:
            own["CUDA_VISIBLE_DEVICES"] = gpu_slice
        envs.append(own)
    return envs


def worker_env(env: dict[str, str], num_workers: int) -> dict[str, str]:
    """Workers share the machine's cores: N workers each running torch on every
    core would oversubscribe a CPU N times over (on GPU machines it costs nothing)."""
    threads = str(max(1, (os.cpu_count() or 1) // num_workers))
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", threads)}


def start_redis(url: str) -> tuple[str, EmbeddedRedis | None]:
    """The Redis at ``url`` if it answers; else an embedded one, on the same
    port when ``url`` is local (so clients configured with it still reach it)."""
    if answers(url):
        log.info("using Redis at %s", url)
        return url, None
    parsed = urlparse(url)
    local = parsed.hostname in ("127.0.0.1", "localhost") and parsed.port
    server = start_embedded_redis(parsed.port if local else None)
    log.info("no Redis answers at %s: started an embedded one at %s", url, server.url)
    return server.url, server


def serve(flags: dict[str, Any], num_workers: int) -> int:
    url, embedded = start_redis(flags.get("redis_url") or RedisSettings().url)
    env = {**os.environ, **as_env(flags), "LIGHTQ_REDIS_URL": url}
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    children: list[Child] = []
    try:
        children += [spawn("worker", own) for own in worker_envs(env, num_workers, visible_gpus(env))]
        children += [spawn("router", env), spawn("producer", env)]
        children.append(spawn("rq-worker", env))  # batch jobs and housekeeping
        return watch(children, stop, Readiness(url, flags, num_workers))
    finally:
        stop_all(children)
        if embedded is not None:
            embedded.stop()


class Readiness:
    """Says once when every worker has a heartbeat (model loaded) and the producer answers."""

    def __init__(self, url: str, flags: dict[str, Any], num_workers: int):
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.keys = Keys(flags.get("redis_key_prefix") or RedisSettings().key_prefix)
        self.http = f"http://{flags.get('host', '127.0.0.1')}:{flags.get('port', 8000)}"
        self.num_workers = num_workers
        self.ready = False

    def check(self) -> None:
        if self.ready:
            return
        live = len(read_registry(self.client, self.keys).live)
        try:
            urllib.request.urlopen(f"{self.http}/health", timeout=1).close()
        except OSError:
            return
        if live >= self.num_workers:
            self.ready = True
            log.info("lightq ready: %d worker(s), producer at %s", live, self.http)


def watch(children: list[Child], stop: threading.Event, readiness: Readiness) -> int:
    """Until stopped, replace dead children (the router re-dispatches a dead worker's
    requests, a new router takes over a dead one's entries, clients of a dead
    producer resume their streams by id); dying over and over stops the pool."""
    restarts = 0
    while not stop.wait(0.5):
        readiness.check()
        for i, (role, env, child) in enumerate(children):
            if child.poll() is None:
                continue
            if restarts < MAX_RESTARTS:
                restarts += 1
                log.warning("%s (pid %d) exited with %d: starting another", role, child.pid, child.returncode)
                children[i] = spawn(role, env)  # a worker's own environment: the same GPUs
                continue
            log.error("%s (pid %d) exited with %d: stopping the pool", role, child.pid, child.returncode)
            return child.returncode or 1
    return 0


def stop_all(children: list[Child]) -> None:
    for _, _, child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for role, _, child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM: killing it", role, child.pid)
            child.kill()
            child.wait()
