"""The prefix cache's two orders by last use, kept as the tree changes (no torch, no walk).

``worker.engine.radix_cache`` stamps a node (``last_used``, from one counter) when it is
created and on every lease taken or given back through it (the whole path, one stamp). Two
questions read those stamps, and before these orders each walked the whole tree:

| question                                   | order                 | cost                      |
|--------------------------------------------|-----------------------|---------------------------|
| which unreferenced leaf to evict next      | ``LeafHeap``: a heap  | O(log n) per push or pop, |
| (``RadixCache.evict``, oldest first)       | of (stamp, node)      | stale entries skipped     |
| what the load record's summary lists       | ``Recency``: every    | O(nodes it reads), newest |
| (``RadixCache.summary``, newest first)     | node, oldest first    | first, about ``limit``    |

On a full 1.6M-token pool each walk cost 4-38 ms of the model loop (bench/engine/radix_bench.py,
bench/RESULTS.md).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from typing import Any, Generic, Protocol, TypeVar


class Stamped(Protocol):
    """What the orders read of a tree node (``radix_cache.Node``); ``newer`` and ``older`` are its
    neighbours in ``Recency`` (the node's own type, which a protocol cannot name)."""

    newer: Any
    older: Any

    @property
    def last_used(self) -> int: ...
    @property
    def ref(self) -> int: ...
    @property
    def children(self) -> Mapping[int, object]: ...
    @property
    def parent(self) -> object | None: ...


N = TypeVar("N", bound=Stamped)


class Recency(Generic[N]):
    """Every node of the tree in a doubly linked list through its ``older``/``newer`` slots,
    oldest first.

    Invariant: stamps never decrease from ``oldest`` to ``newest``, and nodes with equal stamps
    (one path, stamped by one lease) are next to one another. ``touch`` after every stamp
    keeps it: a stamp is always the newest one. A split's upper part keeps the lower part's
    stamp and goes right before it (``add_before``)."""

    def __init__(self) -> None:
        self.oldest: N | None = None
        self.newest: N | None = None

    def add(self, node: N) -> None:
        node.older, node.newer = self.newest, None
        if self.newest is not None:
            self.newest.newer = node
        else:
            self.oldest = node
        self.newest = node

    def add_before(self, node: N, anchor: N) -> None:
        node.older, node.newer = anchor.older, anchor
        if anchor.older is not None:
            anchor.older.newer = node
        else:
            self.oldest = node
        anchor.older = node

    def remove(self, node: N) -> None:
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self.oldest = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self.newest = node.older
        node.older = node.newer = None

    def touch(self, node: N) -> None:
        """``node`` was just stamped: it is the newest now."""
        if node is not self.newest:
            self.remove(node)
            self.add(node)

    def newest_first(self) -> Iterator[N]:
        node = self.newest
        while node is not None:
            yield node
            node = node.older


class LeafHeap(Generic[N]):
    """Unreferenced leaves, oldest stamp first, kept lazily.

    Invariant: every node that is an unreferenced leaf of the tree has an entry with its
    current stamp (``push`` whenever a node becomes one: a new leaf, a lease given back, its
    last child evicted). Entries that no longer hold (the node was leased, got a child, was
    stamped again or left the tree: ``parent`` None) are skipped when popped, and dropped all
    at once when the heap has grown to ``GROWTH`` times what was current at the last drop (a
    pool that never fills never evicts, yet every lease given back pushes), so the heap stays
    O(nodes) and each entry costs amortised O(log n). Stamps of two leaves never tie (one
    stamp is one path), so the order is the walk's."""

    GROWTH = 2

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, N]] = []
        self._seq = itertools.count()  # never compares nodes
        self._bound = 64  # the size that drops the stale entries

    def push(self, node: N) -> None:
        heapq.heappush(self._heap, (node.last_used, next(self._seq), node))
        if len(self._heap) > self._bound:
            self._heap = [entry for entry in self._heap if _current(entry[2], entry[0])]
            heapq.heapify(self._heap)
            self._bound = self.GROWTH * len(self._heap) + 64

    def pop(self) -> N | None:
        """The unreferenced leaf used least recently (out of the heap), or None."""
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if _current(node, stamp):
                return node
        return None

    def __len__(self) -> int:
        return len(self._heap)


def _current(node: Stamped, stamp: int) -> bool:
    """Whether an entry still stands for an unreferenced leaf of the tree."""
    return node.parent is not None and node.ref == 0 and not node.children and node.last_used == stamp
