"""The prefix cache against a brute-force model: a dict from every cached prefix (a tuple of
ids) to the slot of its last token. Random requests start (match + own slots), share their
prefill (extend), end (release) and the pool evicts; after each operation the tree, the pool
and the leases must agree with the model."""

import random

import numpy as np
import pytest

from shared.prefix_hash import prefix_hashes
from worker.engine.radix_cache import NoCache, RadixCache
from worker.engine.token_pool import TokenPool

POOL = 400


def contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """prefix -> slot of its last id, for every prefix the tree holds."""
    out: dict[tuple[int, ...], int] = {}
    todo = [(cache.root, ())]
    while todo:
        node, prefix = todo.pop()
        for i, slot in enumerate(node.slots.tolist()):
            out[prefix + tuple(node.ids[: i + 1].tolist())] = slot
        todo += [(child, prefix + tuple(node.ids.tolist())) for child in node.children.values()]
    return out


class Active:
    def __init__(self, ids, slots, lease):
        self.ids, self.slots, self.lease = ids, slots, lease

    @property
    def held(self) -> int:
        return self.lease.end if self.lease is not None else 0


def nodes(cache: RadixCache) -> list:
    out, todo = [], list(cache.root.children.values())
    while todo:
        node = todo.pop()
        out.append(node)
        todo += node.children.values()
    return out


def lru_evictions(cache: RadixCache, n: int) -> set[tuple[int, ...]]:
    """What evicting ``n`` tokens should take, by brute force over the whole tree: the
    unreferenced leaf used least recently, again and again (a parent whose children all went is
    a leaf); the prefixes those nodes held."""
    prefix = {}
    todo = [(cache.root, ())]
    while todo:
        node, path = todo.pop()
        for child in node.children.values():
            prefix[id(child)] = path + tuple(child.ids.tolist())
            todo.append((child, prefix[id(child)]))
    gone: set[int] = set()
    freed = 0
    while freed < n:
        leaves = [
            x
            for x in nodes(cache)
            if id(x) not in gone and x.ref == 0 and all(id(c) in gone for c in x.children.values())
        ]
        if not leaves:
            break
        oldest = min(leaves, key=lambda x: x.last_used)
        gone.add(id(oldest))
        freed += len(oldest.ids)
    taken = [x for x in nodes(cache) if id(x) in gone]
    return {prefix[id(x)][:k] for x in taken for k in range(x.start + 1, x.end + 1)}


def walked_summary(cache: RadixCache, limit: int) -> list[tuple[int, int]]:
    """The summary by brute force: every boundary of every node, newest first, longer first."""
    ranked = sorted((-x.last_used, -tokens, h) for x in nodes(cache) for tokens, h in x.hashes)
    return [(h, -tokens) for _, tokens, h in ranked[:limit]]


def check(cache: RadixCache, pool: TokenPool, model: dict, active: list[Active]) -> None:
    tree = contents(cache)
    assert tree == model
    assert cache.num_nodes == len(nodes(cache)) == len(list(cache._recency.newest_first()))
    for limit in (1, 5, 1000):
        assert cache.summary(limit) == walked_summary(cache, limit)
    assert cache.num_cached == len(tree)
    held = {a.ids[:k] for a in active for k in range(1, a.held + 1)}
    assert cache.num_evictable == sum(p not in held for p in tree)
    own = [s for a in active for s in a.slots[a.held :].tolist()]
    everything = list(tree.values()) + own + pool._free[: pool.num_free].tolist()
    assert sorted(everything) == list(range(POOL)), "every slot is in exactly one place"
    for a in active:  # a lease's slots are the tree's, unchanged
        assert [model[a.ids[: k + 1]] for k in range(a.held)] == a.slots[: a.held].tolist()


def allocate(cache: RadixCache, pool: TokenPool, n: int) -> np.ndarray:
    if pool.num_free < n:
        cache.evict(n - pool.num_free)
    return pool.allocate(n)


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_agree_with_a_brute_force_model(seed):
    rng = random.Random(seed)
    pool = TokenPool(POOL)
    cache = RadixCache(pool, block=4)
    model: dict[tuple[int, ...], int] = {}
    active: list[Active] = []
    bases = [tuple(rng.randrange(5) for _ in range(rng.randrange(1, 30))) for _ in range(4)]
    for _ in range(300):
        op = rng.random()
        if op < 0.4 and len(active) < 8:
            ids = rng.choice(bases)[: rng.randrange(1, 31)] + tuple(rng.randrange(5) for _ in range(rng.randrange(8)))
            hit, already_held = cache.peek(ids[:-1])
            slots, lease = cache.match(ids[:-1])
            longest = max((k for k in range(len(ids)) if ids[:k] in model or k == 0), default=0)
            assert len(slots) == hit == longest and already_held <= hit
            assert slots.tolist() == [model[ids[: k + 1]] for k in range(hit)]
            if pool.num_free + cache.num_evictable < len(ids) - hit:
                cache.release(ids[:hit], slots, lease)  # no room: give the lease back
                continue
            own = allocate(cache, pool, len(ids) - hit)
            active.append(Active(ids, np.concatenate([slots, own]), lease))
        elif op < 0.55 and active:
            a = rng.choice(active)
            new = cache.extend(a.ids, a.slots, a.lease)
            if new is not None:
                for k in range(a.held, len(a.ids)):
                    model[a.ids[: k + 1]] = int(a.slots[k])
                a.lease = new
        elif op < 0.85 and active:
            a = active.pop(rng.randrange(len(active)))
            for k in range(len(a.ids)):
                model.setdefault(a.ids[: k + 1], int(a.slots[k]))
            cache.release(a.ids, a.slots, a.lease)
        else:
            before, n = dict(model), rng.randrange(1, 60)
            unheld, expected = cache.num_evictable, lru_evictions(cache, n)
            freed = cache.evict(n)
            model = contents(cache)
            removed = set(before) - set(model)
            assert len(removed) == freed >= min(n, unheld)
            assert removed == expected, "least recently used leaves first, as a walk of the whole tree finds"
            held = {a.ids[:k] for a in active for k in range(1, a.held + 1)}
            assert not removed & held, "a leased prefix was evicted"
            assert all(p[:-1] not in removed for p in model), "only leaves go"
        check(cache, pool, model, active)
    for a in active:
        cache.release(a.ids, a.slots, a.lease)
    cache.evict(POOL)
    assert pool.num_free == POOL and cache.num_cached == cache.num_evictable == 0


def test_eviction_takes_the_least_recently_used_leaf_first():
    pool = TokenPool(32)
    cache = RadixCache(pool)
    for ids in ([1, 2, 3, 4], [1, 2, 7, 8], [9, 9]):
        cache.release(ids, pool.allocate(len(ids)), None)
    _, lease = cache.match([1, 2, 3, 4])  # touches [1 2 3 4]: [1 2 7 8] is now the oldest leaf
    cache.release([1, 2, 3, 4], _, lease)
    assert cache.evict(1) == 2
    assert cache.peek([1, 2, 7, 8]) == (2, 0) and cache.peek([1, 2, 3, 4]) == (4, 0)
    assert cache.peek([9, 9]) == (2, 0)


def test_a_lease_keeps_its_path_and_shared_tokens_count_as_held():
    pool = TokenPool(16)
    cache = RadixCache(pool)
    cache.release([1, 2, 3, 4, 5], pool.allocate(5), None)
    slots, lease = cache.match([1, 2, 3])
    assert len(slots) == 3 and cache.num_evictable == 2
    assert cache.peek([1, 2, 3, 4, 6]) == (4, 3)
    assert cache.evict(100) == 2 and cache.num_cached == 3
    cache.release([1, 2, 3], slots, lease)
    assert cache.evict(100) == 3 and pool.num_free == 16


def test_summary_hashes_match_what_the_router_computes_from_a_prompt():
    pool = TokenPool(512)
    cache = RadixCache(pool, block=64)
    prompt = list(range(200))
    cache.release(prompt, pool.allocate(200), None)
    cache.release(prompt[:100] + [7] * 50, pool.allocate(150), None)
    summary = dict(cache.summary(10))
    hashes = prefix_hashes(prompt)
    assert {summary[h] for h in hashes} == {64, 128, 192}
    assert len(summary) == 4  # 64 shared, 128 and 192 of the first, 128 of the second
    assert len(cache.summary(2)) == 2


def test_no_cache_frees_everything_at_release():
    pool = TokenPool(8)
    cache = NoCache(pool)
    slots = pool.allocate(5)
    assert cache.match([1, 2, 3])[1] is None and cache.peek([1, 2]) == (0, 0)
    cache.release([1, 2, 3, 4, 5], slots, None)
    assert pool.num_free == 8


def test_leases_taken_and_given_back_over_and_over_keep_the_leaf_heap_bounded():
    """Each lease given back pushes its leaf again (the old entry goes stale); with nothing ever
    evicted (the pool never fills) the stale entries are still dropped, so the heap does not grow
    with the traffic."""
    pool = TokenPool(64)
    cache = RadixCache(pool)
    prompts = [[1, 2, 3, 4], [1, 2, 7, 8], [9, 9]]
    for ids in prompts:
        cache.release(ids, pool.allocate(len(ids)), None)
    for i in range(1000):
        slots, lease = cache.match(prompts[i % 3])
        cache.release(prompts[i % 3], slots, lease)
        assert len(cache._leaves) <= 2 * cache.num_nodes + 65
    assert cache.evict(1) == 2 and cache.peek([1, 2, 3, 4]) == (4, 0)  # [1 2 3 4] was used last but one
