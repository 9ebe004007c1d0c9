"""The prefix cache: a radix tree of token ids over the KV pool's slots (no torch).

Pages are one token (TokenAttention), so a cached prefix is just the pool
slots of its tokens, shared at token granularity: a request whose ids begin
with a path of the tree points its first table positions at that path's
slots and prefills only the rest (LightLLM's ``dynamic_prompt`` radix cache,
after SGLang's RadixAttention).

Invariants:

- a node holds ``ids`` and the pool ``slots`` of their K/V, for positions
  ``end - len(ids) .. end - 1`` of every sequence through it; children are
  keyed by their first id, so a path of ids is unique;
- ``ref`` counts the leases (``Lease``: the deepest node a request or a
  group's prompt holds) on the node or below it; a node with ``ref`` > 0 is
  never evicted, so a lease's slots stay valid until it is given back;
- the tree owns its slots: they go back to the pool only when evicted, and
  eviction takes unreferenced leaves, least recently used first, only when
  the pool is short (``evict``);
- ``num_evictable`` is the number of tokens in nodes with ``ref`` == 0:
  free slots for admission's purposes, as eviction can hand them out.

A request's slots ``[0, num_locked)`` are the tree's (its lease);
``[num_locked, num_cached)`` are its own until ``release`` inserts them: the
part another request inserted meanwhile is a duplicate and goes back to the
pool, the rest joins the tree.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from shared.prefix_hash import PREFIX_BLOCK, prefix_hashes
from worker.engine.cache_order import LeafHeap, Recency
from worker.engine.token_pool import TokenPool

Ids = Sequence[int]
NO_SLOTS = np.empty(0, dtype=np.int64)


class Node:
    __slots__ = ("children", "parent", "ids", "slots", "ref", "last_used", "end", "hashes", "newer", "older")

    def __init__(self, parent: Node | None, ids: np.ndarray, slots: np.ndarray, end: int):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.ids = ids
        self.slots = slots
        self.ref = 0
        self.last_used = 0
        self.end = end  # tokens from the root to this node's last, inclusive
        self.hashes: list[tuple[int, int]] = []  # (tokens covered, prefix hash) of boundaries ending here
        self.newer: Node | None = None  # neighbours in the cache's ``Recency`` order
        self.older: Node | None = None

    @property
    def start(self) -> int:
        return self.end - len(self.ids)


Lease = Node  # a held path: the deepest node of a request's cached prefix


def lease_path(lease: Lease | None) -> list[tuple[int, int]]:
    """(node identity, tokens) of each node a lease holds, deepest first: what the load record
    counts once however many leases share it (``worker.engine.load``)."""
    path: list[tuple[int, int]] = []
    while lease is not None and lease.parent is not None:
        path.append((id(lease), len(lease.ids)))
        lease = lease.parent
    return path


def held_hashes(leases: Iterable[Lease | None]) -> set[int]:
    """The prefix hashes (``Node.hashes``) of every boundary on the leases' paths: prefixes whose
    tokens the holders count in their load-record states (``worker.engine.load``), so a request
    starting with one adds only the rest there (the router's discount, ``router.admission.worker_view``)."""
    held: set[int] = set()
    seen: set[int] = set()
    for lease in leases:
        node = lease
        while node is not None and node.parent is not None and id(node) not in seen:
            seen.add(id(node))
            held.update(h for _, h in node.hashes)
            node = node.parent
    return held


class PrefixCache(Protocol):
    """What the runner and engine ask of a prefix cache (``RadixCache``, or ``NoCache`` when off)."""

    enabled: bool  # False for ``NoCache``: the load record says so, and routers count no hits here
    num_cached: int
    num_evictable: int
    num_evicted: int

    def match(self, ids: Ids) -> tuple[np.ndarray, Lease | None]: ...
    def peek(self, ids: Ids) -> tuple[int, int]: ...
    def extend(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> Lease | None: ...
    def release(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> None: ...
    def evict(self, num_tokens: int) -> int: ...
    def summary(self, limit: int) -> list[tuple[int, int]]: ...


class NoCache:
    """``--no-prefix_cache``: nothing is matched or kept; a request's slots go back at its end."""

    enabled = False
    num_cached = num_evictable = num_evicted = 0

    def __init__(self, pool: TokenPool):
        self.pool = pool

    def match(self, ids: Ids) -> tuple[np.ndarray, Lease | None]:
        return NO_SLOTS, None

    def peek(self, ids: Ids) -> tuple[int, int]:
        return 0, 0

    def extend(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> Lease | None:
        return None

    def release(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> None:
        self.pool.free(slots)

    def evict(self, num_tokens: int) -> int:
        return 0

    def summary(self, limit: int) -> list[tuple[int, int]]:
        return []


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    same = a[:n] == b[:n]
    return n if bool(same.all()) else int(same.argmin())


class RadixCache:
    enabled = True

    def __init__(self, pool: TokenPool, block: int = PREFIX_BLOCK):
        self.pool = pool
        self.block = block
        self.root = Node(None, NO_SLOTS, NO_SLOTS, 0)
        self.root.ref = 1  # never evicted, never counted
        self.num_cached = 0  # tokens in the tree
        self.num_evictable = 0  # tokens in nodes no lease holds
        self.num_evicted = 0  # tokens evicted so far (a counter)
        self.num_nodes = 0  # nodes in the tree, the root left out
        self._clock = itertools.count(1)
        self._recency: Recency[Node] = Recency()  # every node, by last use (``summary``)
        self._leaves: LeafHeap[Node] = LeafHeap()  # unreferenced leaves, by last use (``evict``)

    # -- reading --------------------------------------------------------------------------------

    def _walk(self, ids: np.ndarray) -> tuple[Node, int, int]:
        """The deepest node the ids reach, how far into it (``matched`` of its ids) and the total
        matched; no change to the tree."""
        node, total = self.root, 0
        while total < len(ids):
            child = node.children.get(int(ids[total]))
            if child is None:
                break
            matched = _common(child.ids, ids[total:])
            total += matched
            if matched < len(child.ids):
                return child, matched, total
            node = child
        return node, len(node.ids), total

    def peek(self, ids: Ids) -> tuple[int, int]:
        """(tokens of ``ids`` the tree holds, those of them some lease holds already): what a
        request would not prefill, and what it would not add to the pool's use."""
        key = np.asarray(ids, dtype=np.int64)
        node, into, total = self._walk(key)
        held = 0
        if node.ref > 0 and node is not self.root:
            held = node.start + into
        else:  # the deepest held ancestor
            ancestor = node.parent
            while ancestor is not None and ancestor.ref == 0:
                ancestor = ancestor.parent
            held = ancestor.end if ancestor is not None else 0
        return total, held

    def match(self, ids: Ids) -> tuple[np.ndarray, Lease | None]:
        """The slots of the longest cached prefix of ``ids``, and a lease on them (None when
        nothing matches): hold it until ``release``."""
        key = np.asarray(ids, dtype=np.int64)
        node, into, total = self._walk(key)
        if total == 0:
            return NO_SLOTS, None
        if into < len(node.ids):
            node = self._split(node, into)
        self._lock(node)
        return self._slots_to(node), node

    def _slots_to(self, node: Node) -> np.ndarray:
        parts: list[np.ndarray] = []
        while node is not self.root:
            parts.append(node.slots)
            assert node.parent is not None
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else NO_SLOTS

    # -- leases ---------------------------------------------------------------------------------

    def _lock(self, node: Node) -> None:
        stamp = next(self._clock)
        while node is not self.root:
            if node.ref == 0:
                self.num_evictable -= len(node.ids)
            node.ref += 1
            node.last_used = stamp
            self._recency.touch(node)
            assert node.parent is not None
            node = node.parent

    def _unlock(self, node: Node) -> None:
        stamp = next(self._clock)
        while node is not self.root:
            node.ref -= 1
            node.last_used = stamp
            self._recency.touch(node)
            if node.ref == 0:
                self.num_evictable += len(node.ids)
                if not node.children:
                    self._leaves.push(node)
            assert node.parent is not None
            node = node.parent

    def extend(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> Lease | None:
        """Share a running request's prefilled ``ids`` now (its own slots join the tree and it holds
        them through a new lease, returned) if the tree holds exactly its lease of them; else
        None and nothing changes (another request inserted a part meanwhile: ``release`` sorts
        the duplicates out at the end)."""
        held = lease.end if lease is not None else 0
        if len(ids) <= held or self.peek(ids)[0] != held:
            return None
        self.insert(ids, slots)
        node, into, total = self._walk(np.asarray(ids, dtype=np.int64))
        assert total == len(ids) == node.end and into == len(node.ids), "the insert ends a node there"
        self._lock(node)  # the whole path, the old lease's part included, before letting go of it
        if lease is not None:
            self._unlock(lease)
        return node

    def release(self, ids: Ids, slots: np.ndarray, lease: Lease | None) -> None:
        """A request (or a group's prompt) lets go of ``slots``, the K/V of ``ids``: its own part
        joins the tree, duplicates of what the tree already holds go back to the pool."""
        held = lease.end if lease is not None else 0
        present = self.insert(ids, slots)
        if present > held:
            self.pool.free(slots[held:present])
        if lease is not None:
            self._unlock(lease)

    # -- changing the tree ----------------------------------------------------------------------

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` after ``at`` of its ids; the new upper part is returned. Leases pass
        through both parts alike, so the upper part takes the node's ``ref``."""
        assert node.parent is not None
        upper = Node(node.parent, node.ids[:at], node.slots[:at], node.start + at)
        upper.ref, upper.last_used = node.ref, node.last_used
        self._recency.add_before(upper, node)  # the same stamp, so next to it
        self.num_nodes += 1
        upper.hashes = [h for h in node.hashes if h[0] <= upper.end]
        node.hashes = [h for h in node.hashes if h[0] > upper.end]
        upper.children[int(node.ids[at])] = node
        node.parent.children[int(upper.ids[0])] = upper
        node.parent = upper
        node.ids, node.slots = node.ids[at:], node.slots[at:]
        return upper

    def insert(self, ids: Ids, slots: np.ndarray) -> int:
        """Put ``ids`` (K/V in ``slots``) in the tree; returns how many leading ids it held
        already (their slots in ``slots`` are not taken: the caller frees them if they are its
        own). The new part is unreferenced."""
        key = np.asarray(ids, dtype=np.int64)
        node, into, present = self._walk(key)
        if into < len(node.ids):
            node = self._split(node, into)
        if present < len(key):
            leaf = Node(node, key[present:].copy(), np.asarray(slots[present : len(key)]).copy(), len(key))
            leaf.last_used = next(self._clock)
            first = present // self.block + 1  # the first boundary past ``present``
            if len(key) // self.block >= first:  # the chain is hashed from the start: only when needed
                listed = ids if isinstance(ids, list) else key.tolist()
                hashes = prefix_hashes(listed, self.block)
                leaf.hashes = [((k + 1) * self.block, h) for k, h in enumerate(hashes) if k + 1 >= first]
            node.children[int(key[present])] = leaf
            self._recency.add(leaf)
            self._leaves.push(leaf)
            self.num_nodes += 1
            self.num_cached += len(leaf.ids)
            self.num_evictable += len(leaf.ids)
        return present

    def evict(self, num_tokens: int) -> int:
        """Give at least ``num_tokens`` slots back to the pool from unreferenced leaves, least
        recently used first (fewer if the rest is held); returns how many. O(log n) per node
        evicted (``LeafHeap``), not a walk of the tree."""
        freed = 0
        while freed < num_tokens and self.num_evictable > freed:
            node = self._leaves.pop()
            if node is None:
                break
            parent = node.parent
            assert parent is not None
            self.pool.free(node.slots)
            del parent.children[int(node.ids[0])]
            self._recency.remove(node)
            node.parent = None  # out of the tree: its heap entries are stale
            self.num_nodes -= 1
            freed += len(node.ids)
            if parent is not self.root and not parent.children and parent.ref == 0:
                self._leaves.push(parent)
        self.num_cached -= freed
        self.num_evictable -= freed
        self.num_evicted += freed
        return freed

    def summary(self, limit: int) -> list[tuple[int, int]]:
        """At most ``limit`` (prefix hash, tokens it covers) pairs of what the tree holds, the most
        recently used paths first, longer before shorter (``shared.prefix_hash``). Reads the
        newest nodes only (``Recency``): once ``limit`` pairs are in hand, a node stamped before
        the last of them cannot rank among them."""
        ranked: list[tuple[int, int, int]] = []  # (stamp, tokens, hash)
        for node in self._recency.newest_first() if limit > 0 else ():
            if len(ranked) >= limit and node.last_used < ranked[-1][0]:
                break
            ranked.extend((node.last_used, tokens, h) for tokens, h in node.hashes)
        ranked.sort(key=lambda entry: (-entry[0], -entry[1]))  # one path per stamp: no ties
        return [(h, tokens) for _, tokens, h in ranked[:limit]]
