"""The prefix cache's bookkeeping on a full pool: what eviction and the load record's summary cost.

    .venv/bin/python -m bench.engine.radix_bench                     # pools of 100K, 400K and 1.6M tokens
    .venv/bin/python -m bench.engine.radix_bench --pools 800000 --repeat 5

A worker whose pool is full of cached tokens evicts on every allocation that
finds too few free slots (``KVSlots.allocate``: at least 1% of the pool at a
time), and rebuilds the summary it publishes at most once a second while busy
(``KVSlots.refresh_summary``); both run on the model loop, between steps. Per
pool size, three trees that fill it (synthetic ids, ``worker.engine.radix_cache``
and ``token_pool`` only, no model):

- ``unique``: prompts that share nothing, 100-1,000 tokens each (ShareGPT-like lengths);
- ``gsp``: SGLang's shared-prefix groups, 2,048-token system prompts and 16 leaves of 384 each;
- ``chat``: conversations of 4 turns, each turn a 256-token step on the one before.

Printed per tree: cached tokens and nodes, the median of ``--repeat`` summaries (ms), one
eviction of 1% of the pool (ms), and the churn of new 400-token requests into the full pool
(allocate, evicting as the worker does, then release into the tree; µs per request).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from worker.engine.kv_slots import SUMMARY_LIMIT, KVSlots
from worker.engine.radix_cache import RadixCache
from worker.engine.token_pool import TokenPool

EVICT_SHARE = 100  # the eviction timed alone: 1% of the pool (what KVSlots.allocate freed at least, before)


def prompts(kind: str, budget: int, rng: np.random.Generator) -> list[list[int]]:
    """Prompts whose tree holds about ``budget`` tokens."""
    out: list[list[int]] = []
    total = 0
    while total < budget:
        if kind == "unique":
            ids = rng.integers(3, 1 << 30, size=int(rng.integers(100, 1001))).tolist()
            out.append(ids)
            total += len(ids)
        elif kind == "gsp":
            system = rng.integers(3, 1 << 30, size=2048).tolist()
            out += [system + rng.integers(3, 1 << 30, size=384).tolist() for _ in range(16)]
            total += 2048 + 16 * 384
        else:  # chat
            history: list[int] = []
            for _ in range(4):
                history = history + rng.integers(3, 1 << 30, size=256).tolist()
                out.append(history)
            total += 4 * 256
    return out


def filled(kind: str, pool_size: int, seed: int) -> tuple[KVSlots, RadixCache]:
    pool = TokenPool(pool_size)
    cache = RadixCache(pool)
    slots = KVSlots(pool, cache)
    for ids in prompts(kind, int(pool_size * 0.98), np.random.default_rng(seed)):
        prefix, lease = cache.match(ids)  # held while the rest is allocated, as a request's
        cache.release(ids, np.concatenate([prefix, slots.allocate(len(ids) - len(prefix))]), lease)
    return slots, cache


def nodes(cache: RadixCache) -> int:
    count, todo = 0, list(cache.root.children.values())
    while todo:
        node = todo.pop()
        count += 1
        todo.extend(node.children.values())
    return count


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(kind: str, pool_size: int, repeat: int, churn: int) -> str:
    slots, cache = filled(kind, pool_size, seed=0)
    cached, num_nodes = cache.num_cached, nodes(cache)
    summary_s = timed(lambda: cache.summary(SUMMARY_LIMIT), repeat)
    evict_s = timed(lambda: cache.evict(pool_size // EVICT_SHARE), 1)  # one: each changes the tree
    rng = np.random.default_rng(1)
    new = [rng.integers(3, 1 << 30, size=400).tolist() for _ in range(churn)]
    start = time.perf_counter()
    for ids in new:
        cache.release(ids, slots.allocate(len(ids)), None)
    churn_s = (time.perf_counter() - start) / churn
    return (
        f"{kind:7s} pool {pool_size:>9,}: {cached:>9,} cached tokens, {num_nodes:>6,} nodes; "
        f"summary {summary_s * 1e3:7.2f} ms, evict 1% {evict_s * 1e3:7.2f} ms, churn {churn_s * 1e6:7.1f} µs/request"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pools", default="100000,400000,1600000", help="pool sizes in tokens, comma-separated")
    p.add_argument("--kinds", default="unique,gsp,chat")
    p.add_argument("--repeat", type=int, default=5, help="summaries timed per tree (the median printed)")
    p.add_argument("--churn", type=int, default=2000, help="new requests pushed through the full pool")
    args = p.parse_args()
    for pool_size in (int(x) for x in args.pools.split(",")):
        for kind in args.kinds.split(","):
            print(measure(kind, pool_size, args.repeat, args.churn), flush=True)


if __name__ == "__main__":
    main()
