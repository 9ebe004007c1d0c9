"""The attention-backend interface and its pure-PyTorch reference.

A backend is chosen once at start-up (the reference on CPU, Triton kernels on
CUDA) and handed to the model; the model never branches on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.kv_mirror import KVMirror
from worker.model.ops import is_triton
from worker.model.positions import position_scores


class AttentionBackend(Protocol):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        alibi_slopes: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend.

        q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied). Writes k, v
        into ``layer``'s pool at ``batch.out_slots``, then for each request b
        attends its new queries over its first ``seq_lens[b]`` pool tokens read
        through ``req_table``, causally (query i of b sees positions
        <= cached_lens[b] + i). Returns [T, Hq, D].

        Position rules (see ``worker.model.positions``), both model constants:
        alibi_slopes [Hq] fp32 adds ALiBi's ``slope[h] * (key_pos - query_pos)``
        to the scaled scores (BLOOM); window W hides keys with
        ``key_pos <= query_pos - W`` (Mistral's sliding window).
        """
        ...


MAX_DECODE_GROUPS = 4  # attended in fp32; in bf16, 2 (``max_decode_groups``)
MIN_DECODE_GROUP = 8


@dataclass(frozen=True)
class _DecodeGroup:
    """Requests of a decode step attended together (sorted by length), and what every layer reuses."""

    members: torch.Tensor | None  # [b] their places in the batch (None: all of it, in order)
    size: int
    slots: torch.Tensor  # [b * L] pool slots to read, padding pointed at each request's first slot
    mask: torch.Tensor  # [b, heads, 1, L] additive, attention dtype: -inf past seq_len and where a rule hides
    new_slots: torch.Tensor  # [b] this step's token of each
    mirror: KVMirror | None  # its K/V kept from the last step (worker.model.kv_mirror), None: gathered


class TorchAttention:
    """The pure-PyTorch backend: the CPU path and the kernels' test oracle.

    Attention runs in the pool's ``attention_dtype`` (torch's fused
    ``scaled_dot_product_attention``, GQA without copying K/V per query head):
    fp32 over an fp32 or FP8 pool; over a bf16 or fp16 pool in that dtype, its
    scores and softmax fp32 inside the kernel and the probabilities rounded to
    it before P V, as the GPU kernels do (an fp32 copy of every key read cost a
    CPU decode step more than it saved). Masked-out keys (past seq_lens, or in the causal future,
    or by a position rule) get probability exactly 0, and no slot a request
    has not written is ever read: a decode step's padding past a request's
    seq_len reads its own position 0 instead, so garbage in unused slots (the
    hold slot, stale slots) can never leak in, not even as NaN.

    The gathers are ``index_select`` on the pool's rows (whole slots, one copy
    each): advanced indexing copied element by element, 2-3x slower on a CPU.
    A decode group's gathered K/V is kept for the next step (``KVMirror``), which
    then copies only its new token per request.
    """

    def __init__(self, cache: KVCache):
        self.cache = cache
        self._step: ForwardBatch | None = None  # the decode step whose groups are kept
        self._groups: dict[tuple, list[_DecodeGroup]] = {}
        self._mirrors: dict[tuple, list[KVMirror]] = {}  # the last decode step's, per position rules

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        alibi_slopes: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        self.cache.store(layer, batch.out_slots.long(), torch.cat((k, v), dim=1))  # quantised when FP8
        rules = dict(alibi_slopes=alibi_slopes, window=window)
        if batch.is_decode:
            return self._decode(layer, q, batch, rules)
        self._mirrors.clear()  # rows may get other requests, requests other tokens: no mirror follows
        return self._prefill(layer, q, batch, rules)

    def _gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, Hkv, L, D] fp32 (views of one copy) of pool slots [B, L]."""
        hkv = self.cache.num_kv_heads
        kv = self.cache.read(layer, slots.reshape(-1)).view(*slots.shape, 2 * hkv, -1)
        kv = kv.transpose(1, 2)  # [B, 2Hkv, L, D]
        return kv[:, :hkv], kv[:, hkv:]

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rel: torch.Tensor | None, rules: dict
    ) -> torch.Tensor:
        """q [B, Hq, Q, D] over keys/values [B, Hkv, L, D]; rel [B, Q, L] = key - query position
        (None: plain causal from the first key) -> [B, Hq, Q, D] fp32."""
        gqa = q.shape[-3] != keys.shape[-3]
        if rel is None:
            return F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, is_causal=True, enable_gqa=gqa)
        mask = self._mask(rel, rules).to(keys.dtype)
        return F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=gqa)

    @staticmethod
    def _mask(rel: torch.Tensor, rules: dict) -> torch.Tensor:
        """The additive mask [B, heads, Q, L] fp32 of the position rules for rel [B, Q, L]: one for
        every head (heads 1) unless ALiBi gives each its own (heads Hq)."""
        alibi = rules["alibi_slopes"]
        heads = 1 if alibi is None else alibi.shape[0]
        B, Q, L = rel.shape
        mask = position_scores(torch.zeros(B * Q, heads, L, device=rel.device), rel.reshape(B * Q, L), **rules)
        return mask.view(B, Q, heads, L).transpose(1, 2)

    def _decode(self, layer: int, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """One query per request, in groups of similar lengths (each padded to its longest)."""
        out = torch.empty_like(q)
        hkv = self.cache.num_kv_heads
        for group in self._decode_groups(batch, rules):
            if group.mirror is not None:
                kv = group.mirror.read(layer, self.cache, group.slots, group.new_slots)  # [b, 2Hkv, L, D]
            else:
                kv = self.cache.read(layer, group.slots).view(group.size, -1, 2 * hkv, self.cache.head_dim)
                kv = kv.transpose(1, 2)  # [b, 2Hkv, L, D]
            qg = q if group.members is None else q.index_select(0, group.members)
            o = self._attend_one(qg, kv[:, :hkv], kv[:, hkv:], group.mask)  # [b, Hq, D]
            if group.members is None:
                out.copy_(o)
            else:
                out.index_copy_(0, group.members, o.to(q.dtype))
        return out

    @staticmethod
    def _attend_one(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One query per request, q [b, Hq, D], over keys/values [b, Hkv, L, D] with an additive mask
        [b, 1 or Hq, 1, L] in their dtype -> [b, Hq, D] in that dtype. The Hq/Hkv query heads that
        share a KV head go in as that head's queries ([b, Hkv, Hq/Hkv, D]; query heads are grouped as
        transformers' repeat_kv has them), so each K/V is read once for all of them: 1.6-1.7x faster than ``enable_gqa``
        with one query each at SmolLM2's shapes on the sandbox (bench/RESULTS.md, 2026-12-05)."""
        b, hq, d = q.shape
        hkv, length = keys.shape[1], keys.shape[2]
        mask = mask if mask.shape[1] == 1 else mask.view(b, hkv, hq // hkv, length)  # ALiBi's per-head rows
        q = q.to(keys.dtype).reshape(b, hkv, hq // hkv, d)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return o.view(b, hq, d)

    def _decode_groups(self, batch: ForwardBatch, rules: dict) -> list[_DecodeGroup]:
        """The step's groups, worked out at its first layer and kept for the others (per position rules:
        a layer's window may differ). Requests sorted by length, then cut into up to MAX_DECODE_GROUPS
        groups of at least MIN_DECODE_GROUP: padding every request to the batch's longest read half as
        many keys again as there were on a 32-request CPU workload; four groups, an eighth."""
        key = (rules["alibi_slopes"] is not None, rules["window"])
        if self._step is not batch:
            self._step, self._groups = batch, {}
        if key not in self._groups:
            self._groups[key] = self._make_groups(batch, rules, self._mirrors.get(key, []))
            self._mirrors[key] = [g.mirror for g in self._groups[key] if g.mirror is not None]
        return self._groups[key]

    def _make_groups(self, batch: ForwardBatch, rules: dict, mirrors: list[KVMirror]) -> list[_DecodeGroup]:
        """Sorted by length (stably: an unchanged batch keeps its groups, and their mirrors, from step to
        step); each group's mirror the last step's one token on, a new one, or none past the budget."""
        B = batch.num_requests
        seq_lens = batch.seq_lens.long()
        count = max(1, min(max_decode_groups(self.cache.attention_dtype), B // MIN_DECODE_GROUP))
        order = torch.argsort(seq_lens, stable=True) if count > 1 else None
        budget = self.cache.nbytes
        groups = []
        for members in torch.tensor_split(order, count) if order is not None else [None]:
            lens = seq_lens if members is None else seq_lens.index_select(0, members)
            rows = batch.req_rows.long() if members is None else batch.req_rows.long().index_select(0, members)
            L = int(lens.max())
            slots = batch.req_table.index_select(0, rows)[:, :L].long()  # [b, L]
            # The query sits at seq_len - 1, so padding past seq_len has rel > 0: hidden, and read from the
            # request's own first slot (written) instead of whatever the table holds there.
            rel = torch.arange(L, device=slots.device)[None, :] - (lens[:, None] - 1)  # [b, L]
            new_slots = slots.gather(1, (lens - 1)[:, None]).reshape(-1)
            slots = torch.where(rel > 0, slots[:, :1], slots).reshape(-1)
            mirror, budget = self._mirror(tuple(rows.tolist()), lens, mirrors, budget)
            mask = self._mask(rel[:, None, :], rules).to(self.cache.attention_dtype)  # once a step, not a layer
            groups.append(_DecodeGroup(members, len(lens), slots, mask, new_slots, mirror))
        return groups

    def _mirror(
        self, rows: tuple[int, ...], lens: torch.Tensor, mirrors: list[KVMirror], budget: int
    ) -> tuple[KVMirror | None, int]:
        """The group's mirror (the last step's extended, else a new one) and what is left of the budget."""
        last = next((m for m in mirrors if m.follows(rows, lens)), None)
        cap = KVMirror.cap_for(lens) if last is None else last.cap
        cost = KVMirror.nbytes(len(rows), cap, self.cache)
        if cost > budget:
            return None, budget
        if last is None:
            return KVMirror(rows, lens, cap, self.cache.num_layers), budget - cost
        return last.advance(lens, self.cache), budget - cost

    def _prefill(self, layer: int, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """A loop over requests: each attends its q_lens[b] queries causally."""
        out = torch.empty_like(q)
        rows = batch.req_rows.tolist()
        starts, lens = batch.q_starts.tolist(), batch.q_lens.tolist()
        cached, seqs = batch.cached_lens.tolist(), batch.seq_lens.tolist()
        plain = rules["alibi_slopes"] is None and rules["window"] is None
        for row, s, n, c, L in zip(rows, starts, lens, cached, seqs):
            keys, values = self._gather(layer, batch.req_table[row : row + 1, :L].long())  # [1, Hkv, L, D] each
            # query i sits at position c + i (4-D throughout: torch's fused CPU kernel wants it)
            rel = (
                None
                if plain and c == 0
                else (
                    torch.arange(L, device=q.device)[None, None, :]
                    - (c + torch.arange(n, device=q.device))[None, :, None]
                )
            )
            out[s : s + n] = self._attend(q[None, s : s + n].transpose(1, 2), keys, values, rel, rules)[0].transpose(
                0, 1
            )
        return out


def max_decode_groups(dtype: torch.dtype) -> int:
    """Groups a CPU decode step is cut into. Four in fp32 (the sandbox's 32 requests read 1.13x their
    keys instead of 1.54x); in a 16-bit dtype each fused attention call costs more next to what its
    padding reads, and two measured ~5% faster a decode step on SmolLM2 in bf16 (bench/RESULTS.md)."""
    return MAX_DECODE_GROUPS if dtype == torch.float32 else 2


def make_backend(cache: KVCache, device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``, chosen once: Triton kernels on CUDA,
    the PyTorch reference elsewhere."""
    if is_triton(device):
        from worker.model.triton_attention import TritonAttention  # triton needs a GPU outside tests

        return TritonAttention(cache)
    return TorchAttention(cache)
