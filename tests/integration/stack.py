"""Start ``lightq serve`` as a real process tree for end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import redis

from router.registry import read_registry
from shared.embedded_redis import free_port
from shared.keys import Keys


@dataclass
class Stack:
    process: subprocess.Popen
    http: str
    redis_url: str
    keys: Keys
    log_path: str

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, decode_responses=True)

    def live_workers(self) -> dict:
        client = self.client()
        try:
            return read_registry(client, self.keys).live
        finally:
            client.close()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def remove_keys(self) -> None:
        """Delete what the stack wrote to a Redis that outlives it (the local one): its prefix's keys
        and the rq keys of its queues (named after the prefix, ``start_stack``). Call after ``stop``."""
        prefix = self.keys.prefix
        client = self.client()
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


def start_stack(
    log_path: str, *, redis_url: str, prefix: str, workers: int, extra: list[str], timeout_s: float = 300
) -> Stack:
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


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1).ping())
    except redis.RedisError:
        return False
