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
