"""``lightq serve``'s child processes: start, output, restart policy, stop.

Each child runs in a session (process group) of its own, so a terminal's
Ctrl-C reaches only ``serve``, which stops the children in order: one
signal each, never two racing (a second signal turns a drain into a kill).
A child's output goes through a pipe to serve's stderr, and its last lines
are kept, to say why a child that keeps failing failed.

A worker that dies after it was ready (``Child.ready``) is restarted however
often it dies: a request may be what kills it (dead-lettered after
``--max_attempts``), and serve must not take every other request down with it.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from shared.service import PARENT_ENV

log = logging.getLogger("lightq.serve")

TAIL_LINES = 15
FAILURES = 3  # a role failing at start-up this many times in a row ends serve
STARTUP_S = 60.0  # roles but the worker: an error exit within this long of the start is a start-up failure
FIRST_DELAY_S, MAX_DELAY_S = 0.5, 30.0


@dataclass
class Child:
    role: str
    env: dict[str, str]  # kept for a restart: a worker's own GPUs and threads
    process: subprocess.Popen
    started: float = field(default_factory=time.monotonic)
    started_ms: int = field(default_factory=lambda: time.time_ns() // 1_000_000)  # the registry's clock
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    output: threading.Thread | None = None  # copies its output
    # A worker is ready once its heartbeat has reached the pool's registry (lightq.launcher.Readiness):
    # routers dispatch only to workers there, so before it no request can have reached it, and a death
    # before it is the worker's own failure to start, never a request's doing.
    ready: bool = False

    def last_lines(self) -> str:
        return "\n".join(self.tail)

    def worker_id(self) -> str:
        """The id a worker child beats under: ``--worker_id``, else host-pid (``shared.service.default_id``,
        which the child computes with its own pid: ours for it)."""
        return self.env.get("LIGHTQ_WORKER_ID") or f"{socket.gethostname()}-{self.process.pid}"

    def flush_output(self, timeout_s: float = 2.0) -> None:
        """Wait until its output is copied, so what serve logs about its exit comes after its own
        last lines (bounded: a process it started may hold the pipe open a while)."""
        if self.output is not None:
            self.output.join(timeout_s)


def spawn(role: str, env: dict[str, str]) -> Child:
    process = subprocess.Popen(
        [sys.executable, "-m", "lightq.cli", role],
        env={**env, PARENT_ENV: str(os.getpid())},  # the child dies with serve (shared.service)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    child = Child(role, env, process)
    child.output = threading.Thread(target=_pump, args=(child,), name=f"{role}-output", daemon=True)
    child.output.start()
    return child


def _pump(child: Child) -> None:
    """Copy the child's output to ours line by line, keeping the last lines."""
    for line in iter(child.process.stdout.readline, b""):
        sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()
        child.tail.append(line.decode(errors="replace").rstrip())
    child.process.stdout.close()


def failed_at_start_up(child: Child, now: float) -> bool:
    """Whether the exited ``child`` failed to start: an exit with an error of its own (code > 0: a bad
    setting, a model that does not load), before a worker was ever ready (however long its model took
    to load), or within STARTUP_S of the start for the other roles (they take no requests of their own)."""
    if child.process.returncode <= 0:  # killed by a signal (the OOM killer, a chaos test), or a clean exit
        return False
    if child.role == "worker":
        return not child.ready
    return now - child.started < STARTUP_S


class RestartPolicy:
    """When a child that exited on its own starts again, or that serve should give up.

    FAILURES start-up failures (``failed_at_start_up``) in a row for one role will not go better
    the next time: give up. Anything else starts again, however often: a child killed by a
    signal, one that ran a while, and a worker that died while serving (a request that kills
    every worker it reaches is dead-lettered after ``--max_attempts``; the pool goes on).
    Restarts of a role back off: 0.5 s, 1 s, 2 s ... 30 s over its recent exits.
    """

    def __init__(self) -> None:
        self.failures: dict[str, int] = {}  # role -> start-up failures in a row
        self.exits: dict[str, list[float]] = {}  # role -> when its children exited, within STARTUP_S

    def delay(self, child: Child, now: float) -> float | None:
        """Seconds to wait before starting another ``child.role``; None: give up."""
        failed = failed_at_start_up(child, now)
        self.failures[child.role] = self.failures.get(child.role, 0) + 1 if failed else 0
        if self.failures[child.role] >= FAILURES:
            return None
        recent = [t for t in self.exits.get(child.role, []) if now - t < STARTUP_S] + [now]
        self.exits[child.role] = recent
        return min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** (len(recent) - 1))


def stop_all(children: list[Child], grace_s: float) -> None:
    """SIGTERM every child at once (workers drain meanwhile), SIGKILL what is left after ``grace_s``."""
    for child in children:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning(
                "%s (pid %d) still running %.0f s after SIGTERM: killing it", child.role, child.process.pid, grace_s
            )
            _kill_group(child.process)
            child.process.wait()
        child.flush_output()


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the child's whole group: its own children too (tensor-parallel ranks, rq's janitor)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
