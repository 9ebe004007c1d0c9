"""The thread that reads the cluster view from Redis, so no request ever waits for it.

At the peak of a burst one read of the view (thousands of queued entries
parsed for their tokens, a status hash per recent request) costs the
producer a second or more of CPU (``python -m bench.serving.scrape_latency
--queued 5000``). Run as a task on the app's event loop, that second blocks
every request the loop serves, ``/metrics`` included. Here it runs on a
thread of its own, with its own event loop and Redis client: the app's loop
is only slowed by sharing the GIL (handed over every few milliseconds), and
``/metrics`` and ``/dashboard/data`` format the last snapshot
(``ProducerMetrics.snapshot``), whatever Redis is doing.

Invariant: this thread is the only caller of ``ProducerMetrics.refresh``
(the request tracker it keeps is not shared); ``refresh_now`` asks it for
a read and waits for that one (tests, and anyone who wants a fresh view).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import redis.asyncio as aioredis

from producer.monitoring.cluster import ClusterSnapshot
from producer.monitoring.metrics import ProducerMetrics
from shared.keys import Keys

log = logging.getLogger(__name__)

START_WAIT_S = 10.0
STOP_WAIT_S = 5.0


class ClusterView:
    def __init__(
        self, metrics: ProducerMetrics, connect: Callable[[], aioredis.Redis], keys: Keys, period_s: float
    ) -> None:
        self.metrics, self.connect, self.keys, self.period_s = metrics, connect, keys, period_s
        self._thread = threading.Thread(target=self._main, name="cluster-view", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._redis: aioredis.Redis | None = None
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        if not self._started.wait(START_WAIT_S):
            raise RuntimeError("the cluster-view thread did not start")

    def stop(self) -> None:
        """Blocking: ends the loop after the read in progress (bounded by the client's timeouts)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(STOP_WAIT_S)

    async def refresh_now(self) -> ClusterSnapshot:
        """A read made now, on the view's thread, awaited from any other loop."""
        assert self._loop is not None, "start() first"
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._refresh(), self._loop))

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _refresh(self) -> ClusterSnapshot:
        assert self._redis is not None
        return await self.metrics.refresh(self._redis, self.keys)

    async def _run(self) -> None:
        self._loop, self._stop, self._redis = asyncio.get_running_loop(), asyncio.Event(), self.connect()
        self._started.set()
        failing = False
        try:
            while not self._stop.is_set():
                try:
                    await self._refresh()
                    failing = False
                except Exception as exc:  # noqa: BLE001 - the thread must outlive any one bad read
                    if not failing:  # once per run of failures: an outage must not flood the log
                        log.warning("cluster view: read failed (%s: %s); serving the last one", type(exc).__name__, exc)
                    failing = True
                try:
                    await asyncio.wait_for(self._stop.wait(), self.period_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self._redis.aclose()
