"""What every service's main() shares: logging, ids, signal handling."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=level or os.environ.get("LIGHTQ_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def default_id(given: str) -> str:
    """``given`` if set, else hostname-pid (unique per process across hosts)."""
    return given or f"{socket.gethostname()}-{os.getpid()}"


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop``; the service loop finishes its step and exits."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


PARENT_ENV = "LIGHTQ_PARENT_PID"  # set by lightq serve for the children it starts


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: SIGTERM this process when its parent dies, even by SIGKILL (``PR_SET_PDEATHSIG``), so
    a killed ``lightq serve`` leaves no pool running without it (nothing would restart its children,
    and they kept its ports: a new serve could not start). ``parent_pid``: the parent it should
    have; one already gone (before the call) ends this process now. Elsewhere: nothing."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def die_with_serve() -> None:
    """``die_with_parent`` for a process ``lightq serve`` started (``PARENT_ENV`` set), else nothing."""
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit():
        die_with_parent(int(parent))
