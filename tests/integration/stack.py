"""Start ``lightq serve`` as a real process tree for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import redis

from router.workers.registry import read_registry
from shared import gguf_meta
from shared.config import RedisSettings
from shared.embedded_redis import free_port
from shared.keys import Keys
from shared.model_files import load_config, load_tokenizer, resolve
from shared.redis import answers, sync_client

COMPILE_TIMEOUT_S = 10  # the SmolLM2 stack's --grammar_compile_timeout_s (smollm2_single, in conftest.py here)
# The shared counting stacks' --drain_timeout and --counting_step_ms. A step of at least 5 ms (a GPU's
# is 6-25) keeps the chaos tests' requests running for a second or more on any machine: 200 tokens
# outlast a heartbeat period or two (the mid-stream kill picks its victim from the workers' records,
# every 0.5 s), 1,000 tokens outlast the drain many times over (the SIGTERM drain). Without the step, on
# a fast 2-core machine the counting model ran ~2,000 steps a second: eight such requests all ended
# within a 0.5 s drain, the SIGTERM test's scan once never caught a young request, and at 1 ms a step
# the mid-stream kill's burst ended between two records (each a 5-minute wait, then a failure).
DRAIN_TIMEOUT_S = 0.1
COUNTING_STEP_MS = 5


@dataclass
class Stack:
    process: subprocess.Popen
    http: str
    redis_url: str
    keys: Keys
    log_path: str
    log_from: int = 0  # where the running test's part of the log starts (SharedStack.get)

    def client(self) -> redis.Redis:
        return sync_client(RedisSettings(url=self.redis_url))

    def live_workers(self) -> dict:
        client = self.client()
        try:
            return read_registry(client, self.keys).live
        finally:
            client.close()

    def test_log(self) -> str:
        """The log since the running test began: what a stack of its own would have logged since then."""
        with open(self.log_path) as f:
            f.seek(self.log_from)
            return f.read()

    def wait_whole(self, workers: int, timeout_s: float = 300) -> None:
        """Until the pool is as it was when it started: ``workers`` live workers, every one of them a
        running process (the record of one a test killed has expired), a live router and a producer
        that answers (serve starts another of each that died, after a back-off)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"lightq serve exited:\n{open(self.log_path).read()[-3000:]}")
            if _healthy(self.http) and self._whole(workers):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the pool was not whole again in {timeout_s} s:\n{open(self.log_path).read()[-3000:]}")

    def _whole(self, workers: int) -> bool:
        try:
            live = self.live_workers()
            client = self.client()
            try:
                routers = list(client.scan_iter(match=self.keys.router_alive("*")))
            finally:
                client.close()
        except redis.RedisError:
            return False
        pids = [_pid(name) for name in [*live, *(key.split(":")[-2].strip("{}") for key in routers)]]
        return len(live) == workers and bool(routers) and all(pid is not None and _running(pid) for pid in pids)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def close(self) -> None:
        """A test's own stack at its fixture's end: stopped, a clean exit asserted (the log's tail
        if not), then its keys removed, even when the stop fails."""
        try:
            assert self.stop() == 0, open(self.log_path).read()[-3000:]
        finally:
            self.remove_keys()

    def remove_keys(self) -> None:
        """Delete what the stack wrote to a Redis that outlives it (the local one): its prefix's keys
        and the rq keys of its queues (named after the prefix, ``start_stack``). Call after ``stop``."""
        remove_prefix_keys(self.redis_url, self.keys.prefix)


def remove_prefix_keys(url: str, prefix: str) -> None:
    """A stack's keys on one Redis server: its prefix's and rq's keys of its queues (named after the
    prefix). For a stack on a cluster, ``url`` is rq's plain Redis (its batches and queues)."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        stale = [
            *client.scan_iter(match=f"{prefix}:*", count=1000),
            *client.scan_iter(match=f"rq:*{prefix}*", count=1000),
        ]
        if stale:
            client.delete(*stale)
        for member in client.smembers("rq:queues"):
            if prefix in member:
                client.srem("rq:queues", member)
    finally:
        client.close()


class SharedStack:
    """One ``lightq serve`` for the tests of several modules. Each start costs a 2-core machine tens
    of seconds of CPU (every child imports torch, each worker loads its model) and each stop a few
    more; a stack per module paid that again and again for pools that differed in nothing the tests
    look at. Started by the first test that asks (``get``); closed (stopped, and its stop checked)
    after the session's last test that uses it: tests/stack_order.py runs a shared stack's tests one
    after another and closes it after the last, so it does not idle through the rest of the suite.
    Before each later test ``get`` waits until the pool is whole again (a test that killed a worker,
    a router or the producer leaves serve starting another), and starts the test's part of the log
    (``Stack.test_log``), so a test meets the stack as it would meet a fresh one: every test waits
    for its own requests to end, so none leaves work behind for the next."""

    def __init__(self, start: Callable[[], Stack], close: Callable[[Stack], None], workers: int):
        self._start, self._close, self.workers = start, close, workers
        self.stack: Stack | None = None
        self._failed: BaseException | None = None

    def get(self) -> Stack:
        if self._failed is not None:
            raise RuntimeError(f"the shared stack did not start: {self._failed}")
        if self.stack is None:
            try:
                self.stack = self._start()
            except BaseException as exc:
                self._failed = exc
                raise
        else:
            self.stack.wait_whole(self.workers)
        with open(self.stack.log_path) as f:
            self.stack.log_from = f.seek(0, os.SEEK_END)
        return self.stack

    def close(self) -> None:
        stack, self.stack = self.stack, None
        if stack is not None:
            self._close(stack)


def warm_model_files(extra: list[str]) -> None:
    """The session's weights cache (tests/conftest.py) holds the embedded GGUF's tokenizer and config
    before a stack that reads them starts: else every process of the session's first such stack
    builds them from the GGUF at once (shared.gguf_meta: ~6 s apiece on two cores, all together)."""
    model = extra[extra.index("--model_dir") + 1] if "--model_dir" in extra else "default"
    cache = os.environ.get("LIGHTQ_WEIGHTS_CACHE", "")
    if model not in ("default", "counting") or not cache:
        return
    source = resolve("default")
    if not os.path.isdir(gguf_meta.meta_folder(cache, source.path, "tokenizer")):
        load_tokenizer(source, cache)
    if model == "default" and not os.path.isdir(gguf_meta.meta_folder(cache, source.path, "config")):
        load_config(source, cache)


def start_stack(
    log_path: str, *, redis_url: str, prefix: str, workers: int, extra: list[str], timeout_s: float = 300
) -> Stack:
    warm_model_files(extra)
    port = free_port()
    # rq queues named after the prefix, so Stack.remove_keys finds their keys on a shared Redis.
    args = [
        sys.executable,
        "-m",
        "lightq.cli",
        "serve",
        "--workers",
        str(workers),
        "--port",
        str(port),
        "--redis_url",
        redis_url,
        "--redis_key_prefix",
        prefix,
        "--batch_queue",
        f"{prefix}-batch",
        "--housekeeping_queue",
        f"{prefix}-janitor",
        *extra,
    ]
    log = open(log_path, "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stack = Stack(process, f"http://127.0.0.1:{port}", redis_url, Keys(prefix), log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"lightq serve exited early:\n{open(log_path).read()[-3000:]}")
        if _healthy(stack.http) and _answers(redis_url) and len(stack.live_workers()) >= workers:
            return stack
        time.sleep(0.5)
    stack.stop()
    raise RuntimeError(f"stack not ready in {timeout_s} s:\n{open(log_path).read()[-3000:]}")


def _healthy(http: str) -> bool:
    try:
        return httpx.get(f"{http}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _pid(service_id: str) -> int | None:
    """A worker's or router's pid, from its default id (host-pid)."""
    tail = service_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _answers(url: str) -> bool:
    return answers(url, timeout_s=1)
