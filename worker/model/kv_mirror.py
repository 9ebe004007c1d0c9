"""A CPU decode group's K/V kept from one step to the next (``TorchAttention``): a step copies one new
token per request out of the pool instead of every request's whole context.

Why: the pool is one row per slot, and a request's slots are scattered (its decode tokens lie a
batch apart), so the CPU path gathers each request's K/V into a contiguous copy for attention. On
the embedded SmolLM2 with 32 requests of ~250 tokens that copy was ~370 MB a decode step, and with
the attention reading it again the two cost as much as the step's matmuls on two cores
(bench/RESULTS.md). Decode steps of an unchanged batch differ by one token a request: a mirror is
gathered once, then extended.

Invariants:
- A mirror belongs to one decode group: its table rows in order (``rows``) and their lengths
  (``lens``). Per layer it holds ``[b, 2 * Hkv, cap, D]`` in the pool's ``attention_dtype``: member
  i's first ``lens[i]`` tokens' K heads then V heads, as ``KVCache.read`` gives them (dequantised
  when FP8), so attention over a mirror sees exactly what a gather would. Positions past a member's
  length hold finite values (zeros, or its first token's K/V as the gather pads), always masked.
- It is extended only by the decode step right after the one that built or extended it, for the
  same rows in the same order, every length one more and none past ``cap`` (``follows``). A forward
  that is not a decode (a prefill, a mixed step: the only way a row gets another request, or a
  request tokens other than one at its end) drops every mirror first (``TorchAttention.forward``).
- Mirrors of one step together stay within a byte budget (the pool's own size): past it a group is
  gathered each step as before.
"""

from __future__ import annotations

import torch

from worker.model.kv_cache import KVCache

HEADROOM = 32  # positions a mirror grows by before it is gathered again (one full gather per 32 steps)


class KVMirror:
    def __init__(self, rows: tuple[int, ...], lens: torch.Tensor, cap: int, num_layers: int):
        self.rows, self.lens, self.cap = rows, lens, cap
        self.length = int(lens.max())  # the longest member's, read by every layer of the step
        self._layers: list[torch.Tensor | None] = [None] * num_layers
        self._append: torch.Tensor | None = None  # flat rows of this step's token per member and head

    @staticmethod
    def nbytes(size: int, cap: int, cache: KVCache) -> int:
        """What a mirror of ``size`` requests and ``cap`` positions costs over every layer."""
        per_position = 2 * cache.num_kv_heads * cache.head_dim * cache.attention_dtype.itemsize
        return size * cap * per_position * cache.num_layers

    @staticmethod
    def cap_for(lens: torch.Tensor) -> int:
        return int(lens.max()) + HEADROOM

    def follows(self, rows: tuple[int, ...], lens: torch.Tensor) -> bool:
        """Whether this step's group (``rows``, ``lens``) is the last one's, one token on."""
        return rows == self.rows and int(lens.max()) <= self.cap and torch.equal(lens, self.lens + 1)

    def advance(self, lens: torch.Tensor, cache: KVCache) -> KVMirror:
        """Ready for the step after ``follows`` said yes: each layer takes one token per member."""
        self.lens, self.length = lens, int(lens.max())
        heads = 2 * cache.num_kv_heads
        member_head = torch.arange(len(self.rows) * heads, device=lens.device).view(-1, heads)
        self._append = (member_head * self.cap + (lens - 1)[:, None]).reshape(-1)
        return self

    def read(self, layer: int, cache: KVCache, slots: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        """K then V heads of the group in ``layer``, [b, 2 * Hkv, L, D] (L = the longest length), after
        this step's store. ``slots`` [b * L]: every position's slot (what a gather reads, padding
        pointed at each member's first slot); ``new_slots`` [b]: this step's token of each member."""
        b, heads, length = len(self.rows), 2 * cache.num_kv_heads, self.length
        buffer = self._layers[layer]
        if buffer is None or self._append is None:  # built this step: gathered whole
            buffer = torch.zeros(b, heads, self.cap, cache.head_dim, dtype=cache.attention_dtype, device=slots.device)
            buffer[:, :, :length] = cache.read(layer, slots).view(b, length, heads, -1).transpose(1, 2)
            self._layers[layer] = buffer
        else:
            buffer.view(-1, cache.head_dim).index_copy_(0, self._append, cache.read(layer, new_slots).flatten(0, 1))
        return buffer[:, :, :length]
