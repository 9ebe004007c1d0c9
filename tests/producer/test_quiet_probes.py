"""The producer's access log leaves out ``lightq serve``'s readiness probes (issue 33 item 5: 116
``GET /health`` lines buried one start's log) and keeps every client's request: a real
``python -m producer.main`` process, its log read after a clean stop, probed by the launcher's own
``Readiness``."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

from lightq.launcher import QUIET_HEALTH, Readiness
from producer.main import QuietProbes
from shared.embedded_redis import free_port


def access(target: str, status: int, method: str = "GET") -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    args = ("127.0.0.1:5555", method, target, "1.1", status)
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None)


def test_only_a_quiet_probes_200_is_left_out():
    quiet = QuietProbes()
    assert not quiet.filter(access("/health?quiet=1", 200))
    assert not quiet.filter(access("/healthz?quiet=1", 200))
    assert quiet.filter(access("/health?quiet=1", 503))  # Redis down: worth a line
    assert quiet.filter(access("/health", 200))  # a client's probe, as before
    assert quiet.filter(access("/health?quiet=0", 200))
    assert quiet.filter(access("/generate?quiet=1", 200))
    assert quiet.filter(access("/health?quiet=1", 405, method="POST"))


def test_serves_probes_leave_the_access_log_and_a_clients_stays(redis_settings, tmp_path, smollm2_tokenizer_dir):
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("LIGHTQ_")}
    env.update(
        PYTHONUNBUFFERED="1", LIGHTQ_REDIS_URL=redis_settings.url, LIGHTQ_REDIS_KEY_PREFIX=redis_settings.key_prefix
    )
    log_path = tmp_path / "producer.log"
    command = [sys.executable, "-m", "producer.main", "--producers", "1", "--port", str(port)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, "--model_dir", smollm2_tokenizer_dir], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        flags = {"host": "127.0.0.1", "port": port, "redis_key_prefix": redis_settings.key_prefix}
        readiness = Readiness(redis_settings.url, flags, num_workers=0)
        while not readiness.ready:  # serve's own loop: a probe every turn until the producer answers
            assert process.poll() is None, log_path.read_text()
            readiness.check()
            time.sleep(0.1)
        for _ in range(3):  # more of serve's probes, answered 200
            urllib.request.urlopen(f"http://127.0.0.1:{port}{QUIET_HEALTH}", timeout=30).close()
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30).close()  # a client's
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)  # a hang guard: it stops in about a second
    lines = log_path.read_text().splitlines()
    assert process.returncode in (0, -signal.SIGTERM), lines  # uvicorn raises the signal again once stopped
    health = [line for line in lines if "/health" in line]
    assert len(health) == 1 and '"GET /health HTTP/1.1" 200' in health[0], lines
