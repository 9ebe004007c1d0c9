"""Issue 32's adapter mix for ``bench.serving.lora_route_bench``: requests naming adapters drawn from a
Zipf law, and the yardstick a router's adapter loads are read against (``lru_bound``)."""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict


def workload(args: argparse.Namespace) -> list[tuple[float, str, list[int]]]:
    """(send at, seconds from the start; adapter; prompt ids): the same in every arm."""
    rng = random.Random(args.seed)
    weights = [1 / (k + 1) ** args.zipf_a for k in range(args.adapters)]
    names = rng.choices([f"a{k}" for k in range(args.adapters)], weights, k=args.requests)
    at, out = 0.0, []
    for name in names:
        at += rng.expovariate(args.request_rate)
        out.append((at, name, [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)]))
    return out


def lru_bound(names: list[str], workers: int, slots: int, aware: bool, seed: int = 0) -> float:
    """Adapter loads per request of ``names`` over ``workers`` LRU caches of ``slots`` adapters: each
    request to a worker holding its adapter (``aware``: an ideal adapter-aware router, records never
    late, never spreading) or to a random one (load-only, when every request costs the same);
    a miss to a random worker. The workload's yardstick: the router's figures against it."""
    rng, caches, loads = random.Random(seed), [OrderedDict[str, None]() for _ in range(workers)], 0
    for name in names:
        holders = [cache for cache in caches if name in cache] if aware else []
        cache = holders[0] if holders else rng.choice(caches)
        if name in cache:
            cache.move_to_end(name)
            continue
        loads += 1
        if len(cache) >= slots:
            cache.popitem(last=False)
        cache[name] = None
    return loads / len(names)
