"""The CPU attention backend's decode in groups of similar lengths, against a dense double-precision reference."""

from __future__ import annotations

import math

import pytest
import torch

from tests.worker.model_harness import build_batch
from worker.model.attention import MAX_DECODE_GROUPS, MIN_DECODE_GROUP, TorchAttention
from worker.model.kv_cache import KVCache
from worker.model.layers import alibi_slopes


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


@pytest.mark.parametrize("rules", ["plain", "window", "alibi"])
@pytest.mark.parametrize("num_requests", [3, 21, 40])
def test_decode_groups_match_the_dense_reference(num_requests, rules):
    """Requests of spread lengths (several groups once there are 16 or more), every slot no request
    owns poisoned with NaN: each request's output is its own dense attention, and nothing leaks."""
    hq, hkv, d, num_slots, layer = 6, 2, 8, 4096, 1
    gen = torch.Generator().manual_seed(num_requests)
    cache = KVCache(2, num_slots, hkv, d, torch.float32, "cpu")
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
        kv = torch.randn(c, 2 * hkv, d, generator=gen)
        cache.buffer[layer, table[row, :c].long()] = kv
        context.append(kv)
        new_slots.append(table[row, c : c + 1])
        start += c + 1
    q = torch.randn(num_requests, hq, d, generator=gen)
    k, v = torch.randn(num_requests, hkv, d, generator=gen), torch.randn(num_requests, hkv, d, generator=gen)
    batch = build_batch(table, rows, lens, [[0]] * num_requests, [s.numpy() for s in new_slots])
    kw = {"plain": {}, "window": {"window": 7}, "alibi": {"alibi_slopes": alibi_slopes(hq)}}[rules]
    out = backend.forward(layer, q, k, v, batch, **kw)

    assert out.shape == q.shape and torch.isfinite(out).all()
    for b, (kv, c) in enumerate(zip(context, lens)):
        keys = torch.cat((kv[:, :hkv], k[b : b + 1]))
        values = torch.cat((kv[:, hkv:], v[b : b + 1]))
        want = _reference(q[b], keys, values, c, kw.get("alibi_slopes"), kw.get("window"))
        torch.testing.assert_close(out[b], want, atol=1e-5, rtol=1e-5)
    groups = backend._decode_groups(batch, {"alibi_slopes": kw.get("alibi_slopes"), "window": kw.get("window")})
    assert len(groups) == max(1, min(MAX_DECODE_GROUPS, num_requests // MIN_DECODE_GROUP))
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
