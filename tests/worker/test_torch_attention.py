"""The CPU attention backend's decode in groups of similar lengths, against a dense double-precision reference."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.model_harness import build_batch
from worker.model.attention import MIN_DECODE_GROUP, TorchAttention, max_decode_groups
from worker.model.kv_cache import KVCache
from worker.model.layers import alibi_slopes
from worker.model.quant import FP8


def _reference(q, keys, values, pos: int, slopes, window):
    """One query at position ``pos`` [Hq, D] over keys/values [L, Hkv, D], the rules written out."""
    hq, d = q.shape
    group = hq // keys.shape[1]
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("hd,lhd->hl", q.double(), keys) / math.sqrt(d)  # [Hq, L]
    rel = torch.arange(keys.shape[0], dtype=torch.float64) - pos
    if slopes is not None:
        scores = scores + slopes.double()[:, None] * rel[None, :]
    hidden = rel > 0
    if window is not None:
        hidden |= rel <= -window
    probs = scores.masked_fill(hidden[None, :], float("-inf")).softmax(-1)
    return torch.einsum("hl,lhd->hd", probs, values).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rules", ["plain", "window", "alibi"])
@pytest.mark.parametrize("num_requests", [3, 21, 40])
def test_decode_groups_match_the_dense_reference(num_requests, rules, dtype):
    """Requests of spread lengths (several groups once there are 16 or more), every slot no request
    owns poisoned with NaN: each request's output is its own dense attention, and nothing leaks. A bf16
    (or fp16) pool is attended in its dtype (``KVCache.attention_dtype``): within its rounding of the
    probabilities and the output."""
    hq, hkv, d, num_slots, layer = 6, 2, 8, 4096, 1
    gen = torch.Generator().manual_seed(num_requests)
    cache = KVCache(2, num_slots, hkv, d, dtype, "cpu")
    cache.buffer.fill_(float("nan"))
    backend = TorchAttention(cache)
    lens = torch.randint(1, 60, (num_requests,), generator=gen).tolist()  # cached tokens before this step
    table = torch.full((num_requests + 1, 64), cache.hold_slot, dtype=torch.int32)
    rows = torch.randperm(num_requests, generator=gen).tolist()
    slots = torch.randperm(num_slots, generator=gen)
    context, new_slots, start = [], [], 0
    for row, c in zip(rows, lens):
        table[row, : c + 1] = slots[start : start + c + 1].int()
        table[row, c + 1 :] = slots[-1 - row]  # stale slots past the end, never written: NaN
        kv = torch.randn(c, 2 * hkv, d, generator=gen).to(dtype)
        cache.buffer[layer, table[row, :c].long()] = kv
        context.append(kv)
        new_slots.append(table[row, c : c + 1])
        start += c + 1
    q = torch.randn(num_requests, hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(num_requests, hkv, d, generator=gen).to(dtype) for _ in range(2))
    batch = build_batch(table, rows, lens, [[0]] * num_requests, [s.numpy() for s in new_slots])
    kw = {"plain": {}, "window": {"window": 7}, "alibi": {"alibi_slopes": alibi_slopes(hq)}}[rules]
    out = backend.forward(layer, q, k, v, batch, **kw)

    assert out.shape == q.shape and torch.isfinite(out).all()
    for b, (kv, c) in enumerate(zip(context, lens)):
        keys = torch.cat((kv[:, :hkv], k[b : b + 1]))
        values = torch.cat((kv[:, hkv:], v[b : b + 1]))
        want = _reference(q[b], keys, values, c, kw.get("alibi_slopes"), kw.get("window"))
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: 8 bits of mantissa (fp16: 11)
        torch.testing.assert_close(out[b].float(), want, atol=tol, rtol=tol)
    groups = backend._decode_groups(batch, {"alibi_slopes": kw.get("alibi_slopes"), "window": kw.get("window")})
    assert len(groups) == max(1, min(max_decode_groups(dtype), num_requests // MIN_DECODE_GROUP))
    assert sum(g.size for g in groups) == num_requests
    assert torch.isnan(cache.buffer[0]).all(), "another layer was written"


def test_a_steps_groups_are_worked_out_once():
    """Every layer of a step reuses its groups; the next step (a new batch) gets its own."""
    cache = KVCache(3, 256, 1, 4, torch.float32, "cpu")
    backend = TorchAttention(cache)
    table = torch.zeros((17, 8), dtype=torch.int32)
    for row in range(16):
        table[row, :3] = torch.tensor([3 * row, 3 * row + 1, 3 * row + 2])

    def step():
        return build_batch(table, list(range(16)), [2] * 16, [[0]] * 16, [table[r, 2:3].numpy() for r in range(16)])

    rules = {"alibi_slopes": None, "window": None}
    batch = step()
    first = backend._decode_groups(batch, rules)
    assert backend._decode_groups(batch, rules) is first
    assert backend._decode_groups(batch, {"alibi_slopes": None, "window": 2}) is not first  # a windowed layer
    assert backend._decode_groups(step(), rules) is not first


class Steps:
    """A pool, a table and requests that decode step after step through one ``TorchAttention``, each
    step checked against the dense reference over the request's K/V as gathered from the pool."""

    hq, hkv, d, layers = 6, 2, 8, 2

    def __init__(self, num_slots: int, kv_dtype: torch.dtype, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = KVCache(self.layers, num_slots, self.hkv, self.d, kv_dtype, "cpu")
        self.cache.buffer.fill_(float("nan"))  # every slot no request wrote
        self.backend = TorchAttention(self.cache)
        self.free = torch.randperm(num_slots, generator=self.gen).tolist()
        self.table = torch.full((65, 128), self.cache.hold_slot, dtype=torch.int32)
        self.lens: dict[int, int] = {}  # row -> tokens in the pool

    def step(self, rows: list[int], new: list[int]) -> None:
        """One forward: ``new[i]`` tokens for the request at ``rows[i]`` (a decode when all are 1)."""
        slots = []
        for row, n in zip(rows, new):
            taken, self.free = self.free[:n], self.free[n:]
            c = self.lens.get(row, 0)
            self.table[row, c : c + n] = torch.tensor(taken, dtype=torch.int32)
            slots.append(torch.tensor(taken).numpy())
        cached = [self.lens.get(row, 0) for row in rows]
        batch = build_batch(self.table, rows, cached, [[0] * n for n in new], slots)
        total = sum(new)
        for layer in range(self.layers):
            q = torch.randn(total, self.hq, self.d, generator=self.gen)
            k, v = (
                torch.randn(total, self.hkv, self.d, generator=self.gen),
                torch.randn(total, self.hkv, self.d, generator=self.gen),
            )
            out = self.backend.forward(layer, q, k, v, batch)
            assert torch.isfinite(out).all()
            if batch.is_decode:
                for b, row in enumerate(rows):
                    kv = self.cache.read(layer, self.table[row, : cached[b] + 1].long())
                    want = _reference(q[b], kv[:, : self.hkv], kv[:, self.hkv :], cached[b], None, None)
                    torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
        for row, n in zip(rows, new):
            self.lens[row] = self.lens.get(row, 0) + n

    def mirrors(self) -> list:
        return self.backend._mirrors.get((False, None), [])


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
def test_decode_steps_extend_their_groups_mirrors_and_a_change_gathers_again(kv_dtype):
    """An unchanged batch's decode steps extend the last step's mirrors (kv_mirror) by one token a
    request; a request leaving regroups; a prefill drops them all, so a row another request takes,
    whose length happens to follow the old one's, is never read from the old request's mirror."""
    s = Steps(4096, kv_dtype, seed=5)
    rows = list(range(20))
    s.step(rows, torch.randint(1, 40, (20,), generator=s.gen).tolist())  # prefill
    s.step(rows, [1] * 20)
    first = s.mirrors()
    assert len(first) == 2 and all(m._append is None for m in first)  # gathered whole
    for _ in range(4):
        s.step(rows, [1] * 20)
        assert [id(m) for m in s.mirrors()] == [id(m) for m in first]  # the same mirrors, extended
        assert all(m._append is not None for m in first)
    rows.remove(7)
    s.step(rows, [1] * 19)  # regrouped: a group that changed is gathered again, one that did not is kept
    assert any(m not in first for m in s.mirrors()) and all(7 not in m.rows for m in s.mirrors())
    length = s.lens[7]
    s.lens[7] = 0  # row 7 goes to a new request, prefilled to the old one's length less one ...
    s.step([7], [length - 1])
    assert s.mirrors() == []
    s.step([*rows, 7], [1] * 20)  # ... so its next decode length follows the old one's
    s.step([*rows, 7], [1] * 20)


def test_mirrors_stay_within_the_pools_bytes():
    """A pool too small for a group's mirror: the group is gathered each step, as before."""
    s = Steps(200, torch.float32, seed=6)
    rows = list(range(16))
    s.step(rows, [8] * 16)
    for _ in range(3):
        s.step(rows, [1] * 16)
    assert s.mirrors() == [] or sum(len(m.rows) * m.cap for m in s.mirrors()) * 2 * 2 * 8 * 4 * 2 <= s.cache.nbytes
