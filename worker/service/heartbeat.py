"""The worker's heartbeat thread: its load record, refreshed every period.

The record is a key with a TTL of three periods, so a dead worker vanishes
on its own; deleting it on exit lets the router re-dispatch at once. When
requests end, ``poke`` makes the next beat come at once: routers admit
against the record, so room freed and not yet published is room left idle
for up to a period. Early beats are spaced by ``EARLY_GAP_COST``x the CPU
time the last beat took (building the record holds the model process's GIL),
at least ``MIN_EARLY_GAP_S``: a small batch's record is cheap and goes out
every few milliseconds; a thousand-request one costs a few milliseconds and
is held to at most 1/``EARLY_GAP_COST`` of the process's CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from shared.codec import encode
from shared.keys import Keys
from shared.redis import REDIS_FAILURES
from shared.request_log import now_ms
from shared.worker_load import WorkerLoad

log = logging.getLogger("lightq.worker")

MIN_EARLY_GAP_S = 0.005
EARLY_GAP_COST = 20  # an early beat waits 20x its own CPU time: beats take at most ~5% of the GIL


class Heartbeat:
    def __init__(
        self, client: redis.Redis, keys: Keys, worker_id: str, period_s: float, read_load: Callable[[int], WorkerLoad]
    ):
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.period_s = period_s
        self.ttl_ms = max(1500, int(3000 * period_s))
        self.read_load = read_load
        self.seq = 0
        self.early_gap_s = MIN_EARLY_GAP_S  # from the last beat's cost (``beat``)
        self.stop_event = threading.Event()
        self._poked = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self.thread.start()

    def beat(self) -> None:
        started = time.thread_time()  # this thread's CPU: the Redis round trip waits without the GIL
        self.seq += 1
        load = self.read_load(self.seq)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.load(self.worker_id), encode(load), px=self.ttl_ms)
        pipe.zadd(self.keys.workers(), {self.worker_id: now_ms()})
        pipe.execute()
        cost = time.thread_time() - started
        self.early_gap_s = min(self.period_s, max(MIN_EARLY_GAP_S, EARLY_GAP_COST * cost))

    def poke(self) -> None:
        """Beat now rather than at the end of the period (requests ended: room was freed)."""
        self._poked.set()

    def _run(self) -> None:
        while True:
            poked = self._poked.wait(self.period_s)
            if self.stop_event.is_set():
                return
            self._poked.clear()
            try:
                self.beat()
            except REDIS_FAILURES as exc:  # keep beating; the TTL covers a short outage
                log.warning("heartbeat failed: %s", exc)
            except Exception:  # never a silent death: a worker that stops beating serves on, unseen by routers
                log.exception("heartbeat: a beat failed; beating on")
            if poked and self.stop_event.wait(self.early_gap_s):  # at most one early beat per gap
                return

    def stop(self) -> None:
        """Stop beating and drop the record: the router treats the worker as gone."""
        self.stop_event.set()
        self._poked.set()  # wakes the thread
        self.thread.join()
        self.client.delete(self.keys.load(self.worker_id))
