"""Where a LoRA request goes when no worker holds its adapter (issue 32): to the worker that loses
the least by paging it in.

A worker pages the adapter into a device slot, evicting another (``worker.lora.adapter_set``). Sent
to the least loaded worker regardless, a miss evicts a popular adapter as readily as a rare one,
and the next request for the popular one is a miss too. The router sees every adapter request, so
it counts them (``Popularity``: decayed counts, recent requests weigh most) and prefers, among the
workers the load trade-off asks, the one whose least popular resident adapter is least popular
(``spare_hits``): a gentle preference (``ADAPTER_SPARE``, a fifth of an adapter hit's worth), so
load still decides between unevenly loaded workers. On issue 32's Zipf mix (bench/RESULTS.md,
Multi-LoRA) a simulation of LRU slots put this at about a tenth fewer loads than misses sent by
load alone.

The worker evicts its least recently used adapter, not its least popular one: the record does not
say which one that is, and on a Zipf mix the two mostly agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

# What a miss's cheapest worker is worth in ``cache_aware_fit``'s hit share: a fifth of an adapter
# hit's 0.5, i.e. 5% of the pool in use ratio (workers further apart than that go by load).
ADAPTER_SPARE = 0.1
# Each counted request weighs 1 / DECAY times the one before: a memory of some thousand requests.
DECAY = 0.999
MAX_WEIGHT = 1e12  # past it the counts are scaled down (and the faintest forgotten): floats stay exact enough
FORGET = 1e-9


class Popularity:
    """Decayed request counts per adapter: ``count`` adds one, ``value`` compares them."""

    def __init__(self) -> None:
        self._counts: dict[str, float] = {}
        self._weight = 1.0  # what the next request adds (grows instead of every count decaying)

    def count(self, adapter: str) -> None:
        self._counts[adapter] = self._counts.get(adapter, 0.0) + self._weight
        self._weight /= DECAY
        if self._weight > MAX_WEIGHT:
            scale = self._weight
            self._counts = {a: c / scale for a, c in self._counts.items() if c / scale > FORGET}
            self._weight = 1.0

    def value(self, adapter: str) -> float:
        return self._counts.get(adapter, 0.0) / self._weight

    def cheapest(self, resident: Sequence[str]) -> float:
        """The value of the least popular of ``resident`` (-1 with none: a free slot, nothing lost)."""
        return min((self.value(a) for a in resident), default=-1.0)


def spare_hits(popularity: Popularity, resident: Mapping[str, Sequence[str]]) -> dict[str, float]:
    """``resident``: worker -> the adapters on its device. The workers whose least popular adapter
    is the least popular of all, with ``ADAPTER_SPARE`` each; none when every worker ties (then
    load alone decides)."""
    values = {worker_id: popularity.cheapest(adapters) for worker_id, adapters in resident.items()}
    if not values or len(set(values.values())) == 1:
        return {}
    low = min(values.values())
    return {worker_id: ADAPTER_SPARE for worker_id, value in values.items() if value == low}
