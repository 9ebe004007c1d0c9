"""Whose pool slots are whose: the token pool and the prefix cache together (no torch).

The runner asks this for every slot it fills and gives every request's slots
back through it (``worker.runner.model_runner``); the engine asks it how much
room there is (``available``). With the prefix cache on, a request's slots
are, by position:

| positions                  | owner                                                  |
|----------------------------|--------------------------------------------------------|
| ``[0, num_locked)``        | the tree (``req.lease``): a cached prefix, or its own  |
|                            | prefill, shared when it completed (``share``)          |
| ``[0, num_shared)``        | a forked group's prompt (``Group``; ``num_locked`` 0)  |
| the rest, to ``num_cached`` | the request itself, until ``release``                 |

A group's prompt slots are held by ``Group.lease`` (the leader's lease, moved
at the fork) and released, like a request's, with the group's last holder.
With the cache off (``NoCache``) nothing is ever locked and a release frees
every own slot, as before the cache existed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from worker.engine.radix_cache import NoCache, PrefixCache
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool

# The cache summary in each load record: at most this many (hash, tokens) pairs (about 40 bytes
# each as JSON), rebuilt at most this often while busy (a rebuild reads about SUMMARY_LIMIT
# entries, ``RadixCache.summary``; when it walked the whole tree, at most once a second).
SUMMARY_LIMIT = 256
SUMMARY_PERIOD_S = 0.25
# A waiting request whose first SHARED_MIN ids equal those of a prefill in progress waits for it
# (``prefill_key``): shorter common prefixes (a chat template's few dozen tokens) are not worth a step.
SHARED_MIN = 256


@dataclass(frozen=True)
class CacheStats:
    """The prefix cache's numbers for the load record and the metrics (all 0 when it is off)."""

    cached: int = 0  # tokens in the tree (leased or evictable)
    evictable: int = 0  # of those, tokens no running request holds
    asked: int = 0  # tokens of admitted requests looked up (prompt + resumed output), since start
    hit: int = 0  # of those, tokens found cached (not prefilled)
    evicted: int = 0  # tokens evicted since start
    enabled: bool = False  # a cache at all (off: --no-prefix_cache)


def _matchable(req: Req) -> list[int]:
    """The ids a request may find cached: all but the last, whose logits it needs; none for one
    asking for prompt logprobs (a cached position has no logits to score it), nor for a LoRA
    adapter's request (its K/V is the adapter's: ``KVSlots.cache_of``)."""
    wants_scores = req.msg.params.prompt_logprobs is not None and not req.output_ids
    if wants_scores or req.msg.adapter is not None:
        return []
    return req.all_ids[: req.num_tokens - 1]


class KVSlots:
    def __init__(self, pool: TokenPool, cache: PrefixCache):
        self.pool = pool
        self.cache = cache
        # A LoRA adapter's requests neither hit nor fill the tree: the tree is keyed by token ids
        # alone, and the same ids under another adapter (or none) have other K/V. Their slots go
        # straight back to the pool (a prefix cache per adapter is for later).
        self.uncached = NoCache(pool)
        self.num_asked = 0  # tokens of requests admitted (prompt + resumed output), for the hit rate
        self.num_hit = 0  # of those, tokens found in the cache (not prefilled)
        self.shared_min = SHARED_MIN  # see ``should_wait``
        self._unwritten: dict[Req, int] = {}  # cached prefixes not yet in their table rows
        # What the cache holds, for the load record: (prefix hash, tokens it covers) pairs.
        self.summary: tuple[tuple[int, int], ...] = ()
        self._summary_at = (0.0, -1)  # (when, cached tokens then)

    @property
    def available(self) -> int:
        """Slots a step may fill: free ones and unreferenced cached ones (evicted on demand)."""
        return self.pool.num_free + self.cache.num_evictable

    def stats(self) -> CacheStats:
        cache = self.cache
        return CacheStats(
            cache.num_cached, cache.num_evictable, self.num_asked, self.num_hit, cache.num_evicted, cache.enabled
        )

    @property
    def num_held(self) -> int:
        """Slots requests hold (their own and cached prefixes they lease); the rest is free or evictable."""
        return self.pool.num_used - self.cache.num_evictable

    def allocate(self, n: int) -> np.ndarray:
        """``n`` slots; when the pool is short, cached ones are evicted, just enough (an eviction
        costs O(log n) per node it frees; when it walked the whole tree it freed at least 1% of
        the pool at a time, so that a full pool did not walk it on every decode step)."""
        short = n - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        return self.pool.allocate(n)

    def refresh_summary(self, idle: bool) -> None:
        """Rebuild ``summary`` if the cache changed: at most every period while busy, at once when
        idle (so a pool at rest shows its last state). The model loop's thread only."""
        then, cached = self._summary_at
        now = time.monotonic()
        if self.cache.num_cached != cached and (idle or now - then >= SUMMARY_PERIOD_S):
            self.summary = tuple(self.cache.summary(SUMMARY_LIMIT))
            self._summary_at = (now, self.cache.num_cached)

    def prefill_key(self, req: Req) -> tuple[int, ...] | None:
        """The first ``shared_min`` ids ``req`` may find cached, when it may find that many and the
        cache is on (None otherwise): two requests with equal keys share at least that prefix."""
        if isinstance(self.cache, NoCache):
            return None
        ids = _matchable(req)
        return tuple(ids[: self.shared_min]) if len(ids) >= self.shared_min else None

    def should_wait(self, req: Req, key: tuple[int, ...] | None, prefilling: set[tuple[int, ...]]) -> bool:
        """Whether ``req`` (its ``prefill_key``) should stay waiting for one of ``prefilling`` (the keys
        of running requests whose prefill has not joined the tree yet) rather than prefill the same
        prefix itself: a burst of prompts sharing a system prompt, all admitted in the step their
        first arrives, would each prefill it (on an H200, SGLang's shared-prefix workload found 0.62
        of its prompt tokens cached where 0.88 could be). Not when the tree already holds the key."""
        return key is not None and key in prefilling and self.cache.peek(_matchable(req))[0] < len(key)

    def held_prefix(self, req: Req) -> int:
        """Tokens of ``req``'s cached prefix that running requests hold already (leased)."""
        return self.cache.peek(_matchable(req))[1]

    def attach_prefix(self, req: Req) -> None:
        """A request starting here takes the longest cached prefix of its ids (all but the last,
        whose logits it needs): those positions are filled before any forward."""
        slots, lease = self.cache.match(_matchable(req))
        n = len(slots)
        req.slot_ids[:n] = slots
        req.num_cached = req.num_locked = n
        req.lease = lease
        self.num_asked += req.num_tokens
        self.num_hit += n
        if n:
            self._unwritten[req] = n

    def share(self, req: Req) -> None:
        """A request's prefill is complete: its slots join the tree now, so requests admitted
        from the next step on can hit them while it runs (unless another request inserted part
        of them meanwhile: then at its release)."""
        if req.num_shared:  # a forked group's member: the prompt is the group's
            return
        n = req.num_cached
        lease = self.cache_of(req).extend(req.all_ids[:n], req.slot_ids[:n], req.lease)
        if lease is not None:
            req.lease, req.num_locked = lease, n

    def fork(self, leader: Req) -> None:
        """The leader's prompt becomes its group's: so does its lease on the cached part."""
        assert leader.group is not None, "only a group's leader forks"
        leader.group.lease, leader.lease, leader.num_locked = leader.lease, None, 0

    def release(self, req: Req) -> None:
        """``req`` gives its slots back: into the tree (or the pool, when the cache is off); a
        member's shared prompt goes with its group's last holder."""
        self._unwritten.pop(req, None)
        group = req.group
        if req.num_shared and group is not None:
            self.pool.free(req.slot_ids[req.num_shared : req.num_cached])
            group.holders -= 1
            if group.holders == 0:
                assert group.prompt_slots is not None
                self.cache_of(req).release(group.msg.prompt_ids, group.prompt_slots, group.lease)
                group.prompt_slots, group.lease = None, None
        else:
            n = req.num_cached
            self.cache_of(req).release(req.all_ids[:n], req.slot_ids[:n], req.lease)
        req.lease, req.num_locked = None, 0

    def cache_of(self, req: Req) -> PrefixCache:
        """Where ``req``'s K/V may be shared: the prefix cache, or nowhere for an adapter's request."""
        return self.uncached if req.msg.adapter is not None else self.cache

    def prefix_writes(self, reqs: list[Req]) -> np.ndarray:
        """[P, 3] (row, position, slot): the cached prefixes of ``reqs`` their table rows do not
        show yet (each written once, with the request's first prefill)."""
        writes: list[np.ndarray] = []
        for req in reqs:
            n = self._unwritten.pop(req, 0)
            if n:
                assert req.row is not None
                positions = np.arange(n, dtype=np.int64)
                writes.append(np.stack([np.full(n, req.row, dtype=np.int64), positions, req.slot_ids[:n]], axis=1))
        return np.concatenate(writes) if writes else np.empty((0, 3), dtype=np.int64)
