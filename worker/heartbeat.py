"""The worker's heartbeat thread: its load record, refreshed every period.

The record is a key with a TTL of three periods, so a dead worker vanishes
on its own; deleting it on exit lets the router re-dispatch at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import redis

from shared.codec import encode
from shared.keys import Keys
from shared.request_log import now_ms
from shared.schemas import WorkerLoad

log = logging.getLogger("lightq.worker")


class Heartbeat:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, period_s: float,
                 read_load: Callable[[int], WorkerLoad]):
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.period_s = period_s
        self.ttl_ms = max(1500, int(3000 * period_s))
        self.read_load = read_load
        self.seq = 0
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self.thread.start()

    def beat(self) -> None:
        self.seq += 1
        load = self.read_load(self.seq)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.load(self.worker_id), encode(load), px=self.ttl_ms)
        pipe.zadd(self.keys.workers(), {self.worker_id: now_ms()})
        pipe.execute()

    def _run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                self.beat()
            except redis.RedisError as exc:  # keep beating; the TTL covers a short outage
                log.warning("heartbeat failed: %s", exc)

    def stop(self) -> None:
        """Stop beating and drop the record: the router treats the worker as gone."""
        self.stop_event.set()
        self.thread.join()
        self.client.delete(self.keys.load(self.worker_id))
