"""The attention-backend interface and its pure-PyTorch reference.

A backend is chosen once at start-up (the reference on CPU, Triton kernels on
CUDA) and handed to the model; the model never branches on the device.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.model.ops import is_triton
from worker.model.positions import position_scores


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, alibi_slopes: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
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


class TorchAttention:
    """The pure-PyTorch backend: the CPU path and the kernels' test oracle.

    Scores and softmax are fp32 whatever the cache dtype (torch's
    ``scaled_dot_product_attention`` on fp32 inputs, GQA without copying K/V
    per query head). Masked-out keys (past seq_lens, or in the causal future,
    or by a position rule) get probability exactly 0, and no slot a request
    has not written is ever read: a decode step's padding past a request's
    seq_len reads its own position 0 instead, so garbage in unused slots (the
    hold slot, stale slots) can never leak in, not even as NaN.

    The gathers are ``index_select`` on the pool's rows (whole slots, one copy
    each): advanced indexing copied element by element, 2-3x slower on a CPU.
    """

    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, alibi_slopes: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
        buf = self.cache.buffer[layer]  # [S+1, 2Hkv, D]
        buf[batch.out_slots.long()] = torch.cat((k, v), dim=1).to(buf.dtype)
        rules = dict(alibi_slopes=alibi_slopes, window=window)
        if batch.is_decode:
            return self._decode(buf, q, batch, rules)
        return self._prefill(buf, q, batch, rules)

    def _gather(self, buf: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, Hkv, L, D] fp32 (views of one copy) of pool slots [B, L]."""
        hkv = self.cache.num_kv_heads
        kv = buf.flatten(1).index_select(0, slots.reshape(-1)).view(*slots.shape, 2 * hkv, -1)
        kv = kv.float().transpose(1, 2)  # [B, 2Hkv, L, D]
        return kv[:, :hkv], kv[:, hkv:]

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rel: torch.Tensor | None,
                rules: dict) -> torch.Tensor:
        """q [B, Hq, Q, D] over keys/values [B, Hkv, L, D]; rel [B, Q, L] = key - query position
        (None: plain causal from the first key) -> [B, Hq, Q, D] fp32."""
        if rel is None:
            return F.scaled_dot_product_attention(q.float(), keys, values, is_causal=True,
                                                  enable_gqa=q.shape[-3] != keys.shape[-3])
        heads = q.shape[-3] if rules["alibi_slopes"] is not None else 1  # else one mask for every head
        B, Q, L = rel.shape
        flat = rel.reshape(B * Q, L)
        mask = position_scores(torch.zeros(B * Q, heads, L, device=q.device), flat, **rules)
        mask = mask.view(B, Q, heads, L).transpose(1, 2)  # [B, heads, Q, L]
        return F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask,
                                              enable_gqa=q.shape[-3] != keys.shape[-3])

    def _decode(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """One query per request: all requests at once, keys padded to max_seq_len."""
        L = batch.max_seq_len
        slots = batch.req_table[batch.req_rows.long(), :L].long()  # [B, L]
        # The query sits at seq_len - 1, so padding past seq_len has rel > 0: hidden, and read
        # from the request's own first slot (written) instead of whatever the table holds there.
        rel = torch.arange(L, device=q.device)[None, :] - (batch.seq_lens[:, None].long() - 1)  # [B, L]
        keys, values = self._gather(buf, torch.where(rel > 0, slots[:, :1], slots))  # [B, Hkv, L, D]
        out = self._attend(q[:, :, None, :], keys, values, rel[:, None, :], rules)  # [B, Hq, 1, D]
        return out[:, :, 0].to(q.dtype)

    def _prefill(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """A loop over requests: each attends its q_lens[b] queries causally."""
        out = torch.empty_like(q)
        rows = batch.req_rows.tolist()
        starts, lens = batch.q_starts.tolist(), batch.q_lens.tolist()
        cached, seqs = batch.cached_lens.tolist(), batch.seq_lens.tolist()
        plain = rules["alibi_slopes"] is None and rules["window"] is None
        for row, s, n, c, L in zip(rows, starts, lens, cached, seqs):
            keys, values = self._gather(buf, batch.req_table[row:row + 1, :L].long())  # [1, Hkv, L, D] each
            # query i sits at position c + i (4-D throughout: torch's fused CPU kernel wants it)
            rel = None if plain and c == 0 else (
                torch.arange(L, device=q.device)[None, None, :] - (c + torch.arange(n, device=q.device))[None, :, None])
            out[s:s + n] = self._attend(q[None, s:s + n].transpose(1, 2), keys, values, rel, rules)[0].transpose(0, 1)
        return out


def make_backend(cache: KVCache, device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``, chosen once: Triton kernels on CUDA,
    the PyTorch reference elsewhere."""
    if is_triton(device):
        from worker.model.triton_attention import TritonAttention  # triton needs a GPU outside tests

        return TritonAttention(cache)
    return TorchAttention(cache)
