"""Overload control at the door: the bounded backlog and the no-worker check.

A request's cost is its prompt plus its estimated output: ``max_new_tokens``
with ``ignore_eos`` or while no request has finished yet, else the mean of
the newest output lengths workers push to ``keys.output_lengths()``, capped
by ``max_new_tokens`` (the estimate ``producer.monitoring.cluster`` shows as queued
tokens). ``store.enqueue`` adds it to the queue unless the queued cost would
pass ``--max_queue_tokens``; then the client gets 429 ``queue_full``, with a
``Retry-After`` of the time the queue needs, at its recent drain rate, to make
room. The drain rate is measured from the enqueue script's own answers:
tokens ever enqueued less tokens queued is what has left the queue.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeout

from producer import store
from producer.api.errors import retry_later
from producer.edge.pool_fit import LIVE_REFRESH_S, PoolFit
from shared.keys import Keys
from shared.schemas import GenerateRequest

HISTORY_LEN = 200  # output lengths the mean is taken over (the router's default window)
HISTORY_REFRESH_S = 1.0
DRAIN_WINDOW_S = 30.0  # drain rate over the last this many seconds
MIN_SPAN_S = 0.5  # below this the rate is noise: answer "soon"
SAMPLE_EVERY_S = 0.05  # bounds the samples kept under a burst
MAX_RETRY_AFTER_S = 60.0


def estimated_output(request: GenerateRequest, mean_len: float | None) -> int:
    """Output tokens still to come, over every sample still open: max_new_tokens with ignore_eos
    or no history, else the recent mean; less what each sample emitted before a requeue."""
    max_new, total = request.params.max_new_tokens, 0
    for choice in request.open_choices:
        done = len(request.emitted(choice))
        if request.params.ignore_eos or mean_len is None:
            total += max_new - done
        else:
            total += max(1, min(max_new - done, round(mean_len) - done))
    return total


class DrainRate:
    """Tokens that left the queue per second, from (time, total enqueued - queued) samples."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def observe(self, now: float, drained: int) -> None:
        if self.samples and drained < self.samples[-1][1]:
            self.samples.clear()  # the counter restarted (Redis lost its data): old samples mean nothing
        if self.samples and now - self.samples[-1][0] < SAMPLE_EVERY_S:
            self.samples[-1] = (self.samples[-1][0], drained)
        else:
            self.samples.append((now, drained))
        while len(self.samples) > 2 and now - self.samples[1][0] >= DRAIN_WINDOW_S:
            self.samples.popleft()

    def retry_after(self, excess_tokens: int) -> float:
        """Seconds until ``excess_tokens`` more have drained, at the recent rate.

        Unknown rate (just started, or a burst): soon, by then it is known. Nothing drained
        lately: as long as it has been stalled, so waits grow while the pool is stuck.
        """
        if len(self.samples) < 2 or self.samples[-1][0] - self.samples[0][0] < MIN_SPAN_S:
            return 1.0
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        span = t1 - t0
        wait = span if d1 <= d0 else excess_tokens * span / (d1 - d0)
        return min(MAX_RETRY_AFTER_S, max(1.0, wait))


class Gate:
    """What a producer checks before it writes a request (one per app; state is per replica).

    ``deadline_s`` bounds the checks and the write together: past it the request is a 503
    (``RedisTimeout``). A single server's client already fails within about that (a timeout and one
    retry), but a cluster client reaching no node tries every seed node in turn, each with its connect
    timeout, and retries that: 7-14 s with the producer's host cut off. A write cut short may still
    have queued the request: it runs unread and expires, as a request whose client left does.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        max_queue_tokens: int,
        require_workers: bool,
        deadline_s: float | None = None,
    ) -> None:
        self.redis, self.keys, self.deadline_s = redis, keys, deadline_s
        self.max_queue_tokens, self.require_workers = max_queue_tokens, require_workers
        self.drain = DrainRate()
        self._mean_len: float | None = None
        self._mean_read_at = -math.inf
        self.fit = PoolFit(redis, keys)

    async def mean_output_length(self) -> float | None:
        now = time.monotonic()
        if now - self._mean_read_at >= HISTORY_REFRESH_S:
            lengths = [int(x) for x in await self.redis.lrange(self.keys.output_lengths(), 0, HISTORY_LEN - 1)]
            self._mean_len = sum(lengths) / len(lengths) if lengths else None
            self._mean_read_at = now
        return self._mean_len

    async def check_workers(self) -> None:
        """503 ``no_workers`` while no worker has a heartbeat (only with --reject_without_workers)."""
        if self.require_workers and not await self.fit.any_live():
            raise retry_later(503, "no worker is serving; retry later", "no_workers", LIVE_REFRESH_S * 2)

    async def enqueue(self, request: GenerateRequest, ttl_s: int, key_hash: str | None) -> None:
        """Write the request, or raise 429 ``queue_full`` when the backlog has no room for it."""
        try:
            async with asyncio.timeout(self.deadline_s):
                await self._enqueue(request, ttl_s, key_hash)
        except TimeoutError as exc:
            raise RedisTimeout(f"Redis did not take the request within {self.deadline_s:g} s") from exc

    async def _enqueue(self, request: GenerateRequest, ttl_s: int, key_hash: str | None) -> None:
        await self.check_workers()
        await self.fit.check(request)  # 400 when no live worker could ever hold it (producer.edge.pool_fit)
        # A group's samples share the prompt: it is counted once, each sample's output once.
        cost = request.num_prompt_tokens + estimated_output(request, await self.mean_output_length())
        result = await store.enqueue(
            self.redis, self.keys, request, ttl_s, cost=cost, max_queue_tokens=self.max_queue_tokens, key_hash=key_hash
        )
        if result.queued_tokens >= 0:
            self.drain.observe(time.monotonic(), result.total_tokens - result.queued_tokens)
        if not result.accepted:
            excess = result.queued_tokens + cost - self.max_queue_tokens
            raise retry_later(
                429,
                f"the queue is full: {result.queued_tokens} tokens queued, this request needs {cost}, "
                f"the limit is {self.max_queue_tokens}; retry later",
                "queue_full",
                self.drain.retry_after(excess),
                kind="rate_limit_error",
            )
