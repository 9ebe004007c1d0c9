"""The attention-backend interface and its pure-PyTorch reference.

A backend is chosen once at start-up (the reference on CPU, Triton kernels on
CUDA) and handed to the model; the model never branches on the device.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

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
    """The pure-PyTorch reference backend: the CPU path and the kernels' test oracle.

    Scores and softmax are fp32 whatever the cache dtype. Masked-out keys
    (past seq_lens, or in the causal future) get probability exactly 0 and
    their values are zeroed before the weighted sum, so garbage in unused
    slots (the hold slot, stale slots) can never leak in, not even as NaN.
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

    def _split_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hkv = self.cache.num_kv_heads
        return kv[..., :hkv, :].float(), kv[..., hkv:, :].float()

    def _probs(self, q: torch.Tensor, keys: torch.Tensor, rel: torch.Tensor, rules: dict) -> torch.Tensor:
        """Softmax [Q, Hq, L] of queries q [Q, Hq, D] over keys [Q, L, Hkv, D] (each its
        own) or [L, Hkv, D] (shared by all; no per-query copy)."""
        Q, Hq, D = q.shape
        hkv = keys.shape[-2]
        qg = q.float().view(Q, hkv, Hq // hkv, D)  # [Q, Hkv, G, D]
        scores = torch.einsum(f"qhgd,{_kv_dims(keys)}->qhgl", qg, keys) / math.sqrt(D)
        return torch.softmax(position_scores(scores.reshape(Q, Hq, -1), rel, **rules), dim=-1)

    def _weighted(self, probs: torch.Tensor, values: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """probs [Q, Hq, L] x values [Q, L, Hkv, D] or [L, Hkv, D] -> [Q, Hq, D]."""
        Q, Hq, L = probs.shape
        hkv = values.shape[-2]
        pg = probs.view(Q, hkv, Hq // hkv, L)  # [Q, Hkv, G, L]
        out = torch.einsum(f"qhgl,{_kv_dims(values)}->qhgd", pg, values)
        return out.reshape(Q, Hq, -1).to(out_dtype)

    def _decode(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """One query per request: all requests at once, keys padded to max_seq_len."""
        L = batch.max_seq_len
        slots = batch.req_table[batch.req_rows.long(), :L].long()  # [B, L]
        keys, values = self._split_kv(buf[slots])  # [B, L, Hkv, D] each
        # The query sits at seq_len - 1, so padding past seq_len has rel > 0: hidden.
        rel = torch.arange(L, device=q.device)[None, :] - (batch.seq_lens[:, None] - 1)  # [B, L]
        values = values.masked_fill((rel > 0)[:, :, None, None], 0.0)
        return self._weighted(self._probs(q, keys, rel, rules), values, q.dtype)

    def _prefill(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch, rules: dict) -> torch.Tensor:
        """A loop over requests: each attends its q_lens[b] queries causally."""
        out = torch.empty_like(q)
        rows = batch.req_rows.tolist()
        starts, lens = batch.q_starts.tolist(), batch.q_lens.tolist()
        cached, seqs = batch.cached_lens.tolist(), batch.seq_lens.tolist()
        for row, s, n, c, L in zip(rows, starts, lens, cached, seqs):
            slots = batch.req_table[row, :L].long()  # [L]
            keys, values = self._split_kv(buf[slots])  # [L, Hkv, D] each
            # query i sits at position c + i
            rel = torch.arange(L, device=q.device)[None, :] - (c + torch.arange(n, device=q.device))[:, None]
            out[s:s + n] = self._weighted(self._probs(q[s:s + n], keys, rel, rules), values, q.dtype)
        return out


def _kv_dims(kv: torch.Tensor) -> str:
    return "qlhd" if kv.dim() == 4 else "lhd"


def make_backend(cache: KVCache, device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``, chosen once: Triton kernels on CUDA,
    the PyTorch reference elsewhere."""
    if is_triton(device):
        from worker.model.triton_attention import TritonAttention  # triton needs a GPU outside tests

        return TritonAttention(cache)
    return TorchAttention(cache)
