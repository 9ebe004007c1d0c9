"""A worker started before its Redis (compose, a host that boots first) waits for it, saying why,
and serves once it answers: before, its publisher process died on the first PING and the worker
exited blaming its publisher. A real worker process (counting model) and a real Redis started late."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import redis

from shared.embedded_redis import free_port, start_embedded_redis
from shared.keys import Keys
from tests.waiting import MUST_HAPPEN_S


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + MUST_HAPPEN_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_a_worker_waits_for_its_redis_and_then_serves(tmp_path):
    port, log_path = free_port(), tmp_path / "worker.log"
    args = [sys.executable, "-m", "lightq.cli", "worker", "--model_dir", "counting", "--worker_id", "w-late"]
    args += ["--redis_url", f"redis://127.0.0.1:{port}/0", "--redis_key_prefix", "lightq-late"]
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    server = None
    try:
        wait_for(lambda: "Redis unreachable" in log_path.read_text(), "the worker must say it waits for Redis")
        assert worker.poll() is None, log_path.read_text()
        server = start_embedded_redis(port=port)
        client = redis.Redis.from_url(server.url)
        wait_for(lambda: client.exists(Keys("lightq-late").load("w-late")), "the worker must serve once Redis answers")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(MUST_HAPPEN_S) == 0, log_path.read_text()
        client.close()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if server is not None:
            server.stop()
    text = log_path.read_text()
    assert "died" not in text and "Traceback" not in text, text
