"""``lightq serve``: the whole pool on one machine, as child processes.

Every setting and the model source are checked before anything starts
(``lightq.checks``). Redis: an embedded, append-only one of its own unless a
URL is given (``lightq.serve_redis``). Then ``--workers N`` workers, one
router, the producer and the rq worker, each a separate process configured
through ``LIGHTQ_*`` environment variables (``lightq.children``).

A child that dies on its own is replaced, whichever it was: no request
lives in a process (the queue, every request's status and its tokens are in
Redis), so a new producer, router or worker carries on where the dead one
stopped. Restarts back off, and a child failing at start-up again and again
ends serve with its own last lines, so a broken pool never looks alive; a
worker that dies while serving is restarted however often it dies (a request
that keeps killing workers is dead-lettered, and the others go on).

Ctrl-C or SIGTERM stops the children (SIGTERM; workers get their
``--drain_timeout`` and a margin to finish and hand back before SIGKILL),
then Redis, last, so everything they hand back on the way out is kept.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import urllib.request
from typing import Any

from lightq.children import FAILURES, Child, RestartPolicy, failed_at_start_up, spawn, stop_all
from lightq.serve_redis import ServeRedis, open_redis
from router.workers.registry import read_registry
from shared.config import RedisSettings, ServeSettings
from shared.flags import as_env, build
from shared.producer_settings import ProducerSettings
from shared.redis import REDIS_FAILURES, cluster_seeds, is_cluster, sync_client
from shared.worker_settings import WorkerSettings

log = logging.getLogger("lightq.serve")

# serve's readiness probe: the producer leaves its 200s out of the access log (producer.main.QuietProbes)
QUIET_HEALTH = "/health?quiet=1"
GRACE_S = 10.0  # producer, router, rq worker: enough for a clean exit
DRAIN_MARGIN_S = 15.0  # a worker's hand-back after its --drain_timeout


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
    explicitly (``cuda:N``, ``cpu``). With ``--tp 1`` and more workers than
    GPUs, workers share GPUs round-robin (each then sizes its pool by its
    share, ``gpu_shares``): a small model uses a big GPU better as several
    workers, and cache-aware routing can be measured on one GPU. Too few GPUs
    for ``--tp`` > 1 fail here, before anything starts.
    """
    tp = int(env.get("LIGHTQ_TP", "1"))
    if not gpus or env.get("LIGHTQ_DEVICE", "auto") not in ("auto", "cuda"):
        return [None] * num_workers
    if tp == 1:
        return [gpus[i % len(gpus)] for i in range(num_workers)]
    if len(gpus) < num_workers * tp:
        raise SystemExit(
            f"--workers {num_workers} x --tp {tp} needs {num_workers * tp} GPUs; {len(gpus)} visible ({','.join(gpus)})"
        )
    return [",".join(gpus[i * tp : (i + 1) * tp]) for i in range(num_workers)]


def gpu_shares(slices: list[str | None]) -> list[float]:
    """Each worker's part of its GPU's memory: 1 / the workers given the same GPUs."""
    return [1.0 if s is None else 1.0 / slices.count(s) for s in slices]


def worker_envs(env: dict[str, str], num_workers: int, gpus: list[str]) -> list[dict[str, str]]:
    """One environment per worker: its GPUs (and its share of them, where workers share one), and its
    share of the CPU threads; on a CPU, glibc's malloc settings for big temporaries (``CPU_MALLOC``)."""
    envs = []
    slices = gpu_slices(env, num_workers, gpus)
    for gpu_slice, share in zip(slices, gpu_shares(slices), strict=True):
        own = worker_env(env, num_workers)
        if gpu_slice is not None:
            own["CUDA_VISIBLE_DEVICES"] = gpu_slice
        if share < 1:
            own["LIGHTQ_GPU_SHARE"] = repr(share)
        if runs_on_cpu(env, gpus):
            own = {**CPU_MALLOC, **own}  # the environment's own values win
        envs.append(own)
    return envs


# A CPU worker's prefill makes tensors of tens of MB per layer (4,096 tokens x the MLP: 50 MB for
# SmolLM2), above glibc's largest mmap threshold (32 MB): each was mapped, faulted in page by page and
# unmapped again, 10-15% of a prefill in system time on the 2-core sandbox (bench/RESULTS.md). From the
# heap instead, and kept there (the heap is trimmed only past 1 GiB free), they are reused. glibc reads these at start;
# other C libraries ignore them.
CPU_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def runs_on_cpu(env: dict[str, str], gpus: list[str]) -> bool:
    """Whether serve's workers will run on the CPU: ``--device cpu``, or ``auto`` with no GPU visible."""
    device = env.get("LIGHTQ_DEVICE", "auto")
    return device == "cpu" or (device == "auto" and not gpus)


def worker_env(env: dict[str, str], num_workers: int) -> dict[str, str]:
    """Workers share the machine's cores: N workers each running torch on every
    core would oversubscribe a CPU N times over (on GPU machines it costs nothing)."""
    threads = str(max(1, (os.cpu_count() or 1) // num_workers))
    return {**env, "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", threads)}


class StopAsked:
    """A stop a signal asked for. The handler only sets an attribute: a ``threading.Event``'s ``set``
    takes a lock, and a second signal landing while the first handler held it (Ctrl-C twice, a
    supervisor's SIGTERM after a user's) re-entered ``set`` on the same thread and hung serve for good."""

    def __init__(self) -> None:
        self.asked = False

    def ask(self, *_: object) -> None:
        self.asked = True

    def wait(self, seconds: float) -> bool:
        """Whether a stop was asked, after sleeping ``seconds`` unless it already was."""
        if not self.asked:
            time.sleep(seconds)
        return self.asked


def serve(flags: dict[str, Any], num_workers: int) -> int:
    """Run the pool until a signal (0) or a child that keeps failing (its exit code)."""
    stop = StopAsked()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop.ask)
    http_port = build(ProducerSettings, flags).port
    store = open_redis(flags, build(ServeSettings, flags).data_dir, http_port)
    env = {**os.environ, **as_env(flags), "LIGHTQ_REDIS_URL": store.url}
    grace_s = max(GRACE_S, build(WorkerSettings, flags).drain_timeout + DRAIN_MARGIN_S)
    children: list[Child] = []
    try:
        children += [spawn("worker", own) for own in worker_envs(env, num_workers, visible_gpus(env))]
        children += [spawn("router", env), spawn("producer", env)]
        redis_settings = build(ProducerSettings, flags).redis.model_copy(update={"url": store.url})
        if redis_settings.batch_url:
            children.append(spawn("rq-worker", env))  # batch jobs and housekeeping
        else:
            log.warning("a Redis Cluster without --redis_rq_url: no rq worker (no batches, no housekeeping)")
        return watch(children, stop, Readiness(store.url, flags, num_workers), store)
    finally:
        if children:
            log.info("stopping: workers get up to %.0f s to drain and hand back", grace_s)
        stop_all(children, grace_s)
        store.stop()  # last: what the children handed back on their way out is in it
        log.info("lightq stopped")


def cli_address(url: str) -> str:
    """redis-cli's arguments for ``url``: ``-u URL``, or for a cluster ``-c -h HOST -p PORT`` (a seed)."""
    if not is_cluster(url):
        return f"-u {url}"
    host, port = cluster_seeds(url)[0][0]
    return f"-c -h {host} -p {port}"


class Readiness:
    """Says once when every worker has a heartbeat (model loaded) and the producer answers; marks
    each worker child ready when its own heartbeat first reaches the registry (``mark``)."""

    def __init__(self, url: str, flags: dict[str, Any], num_workers: int):
        producer = build(ProducerSettings, flags)
        self.client = sync_client(RedisSettings(url=url))
        self.keys = producer.redis.keys
        self.http = f"http://{producer.host}:{producer.port}"
        self.redis_url = url  # said with the ready line: where to listen from outside (redis-cli -u)
        self.num_workers = num_workers
        self.ready = False

    def check(self) -> None:
        if self.ready:
            return
        try:
            live = len(read_registry(self.client, self.keys).live)
        except REDIS_FAILURES:  # Redis restarting: ask again next time
            return
        if live < self.num_workers:  # the producer is asked once the workers are up, not every turn
            return
        try:
            urllib.request.urlopen(f"{self.http}{QUIET_HEALTH}", timeout=1).close()
        except OSError:
            return
        self.ready = True
        log.info(
            "lightq ready: %d worker(s), producer at %s, Redis at %s (key prefix %r: redis-cli %s)",
            live,
            self.http,
            self.redis_url,
            self.keys.prefix,
            cli_address(self.redis_url),
        )

    def mark(self, children: list[Child]) -> None:
        """``Child.ready`` for each worker whose id the registry has listed since the child started.

        The registry (``keys.workers()``: worker id -> time of its last beat) is what routers
        dispatch from, so it is the exact line between "no request can have reached it" and "one
        may have". A beat's time at or after the child's start rules out an earlier process's entry
        under the same ``--worker_id``. A worker that beats and dies at once is still seen: its
        entry stays until a router reaps it, after its record's TTL (at least 1.5 s, three of our
        0.5 s turns, and this runs at the top of each turn, before deaths are looked at)."""
        waiting = [c for c in children if c.role == "worker" and not c.ready]
        if not waiting:
            return
        try:
            beats = self.client.zmscore(self.keys.workers(), [c.worker_id() for c in waiting])
        except REDIS_FAILURES:  # Redis restarting: ask again next turn
            return
        for child, beat in zip(waiting, beats, strict=True):
            if beat is not None and beat >= child.started_ms:
                child.ready = True

    def forget(self, child: Child) -> None:
        """A worker child that exited: its load record goes now, so routers stop choosing it and hand
        its inbox on at their next read, not when the record's TTL runs out (1.5 s or more: a request
        sent meanwhile waited that long beside an idle worker, red team 7). It means what the
        record's expiry means (a router's janitor fences the worker before its inbox moves)."""
        if child.role != "worker":
            return
        try:
            self.client.delete(self.keys.load(child.worker_id()))
        except REDIS_FAILURES:  # Redis restarting: the record's TTL ends it as before
            pass


def watch(children: list[Child], stop: StopAsked, readiness: Readiness, store: ServeRedis) -> int:
    """Until stopped, replace dead children (the router re-dispatches a dead worker's
    requests, a new router takes over a dead one's entries, clients of a dead
    producer resume their streams by id), after a back-off; one that keeps failing ends serve."""
    policy = RestartPolicy()
    due: dict[int, float] = {}  # child index -> when to start it again
    while not stop.wait(0.5):
        store.keep_alive()
        readiness.mark(children)  # before deaths are looked at: a worker that beat and died is seen ready
        readiness.check()
        now = time.monotonic()
        for i, child in enumerate(children):
            if child.process.poll() is None:
                continue
            if i in due:
                if now >= due[i]:
                    children[i] = spawn(child.role, child.env)  # a worker's own environment: the same GPUs
                    del due[i]
                continue
            child.flush_output()
            readiness.forget(child)
            at_start_up = failed_at_start_up(child, now)
            delay = policy.delay(child, now)
            if delay is None:
                log.error(
                    "%s failed at start-up %d times in a row; its last lines:\n%s\nlightq: stopping: %s exited with %d",
                    child.role,
                    FAILURES,
                    child.last_lines(),
                    child.role,
                    child.process.returncode,
                )
                return child.process.returncode or 1
            log_restart(child, at_start_up, delay)
            due[i] = now + delay
    return 0


def log_restart(child: Child, at_start_up: bool, delay: float) -> None:
    code = child.process.returncode
    why = ""
    if at_start_up:
        why = f" (a failure at start-up: {FAILURES} in a row end serve)"
    elif child.ready and code != 0:  # a worker: what it held goes back to the queue, counted against --max_attempts
        why = " (it died while serving requests: one that keeps killing workers is dead-lettered at --max_attempts)"
    log.warning(
        "%s (pid %d) exited with %d%s: starting another in %.1f s", child.role, child.process.pid, code, why, delay
    )
