"""The two attention kernels' PyTorch references, what tests and benchmarks check them against:
plain PyTorch in fp32, one request at a time, the position rules (causality, ALiBi, the window) from
``worker.model.positions.position_scores``, an FP8 pool dequantised first (``dequantized``)."""

from __future__ import annotations

import math

import torch

from worker.model.positions import position_scores


def dequantized(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [len(slots), Hkv, D] of a pool view [S, Hkv, D]; an FP8 one times its scales [S, Hkv]."""
    rows = cache[slots].float()
    return rows if scale is None else rows * scale[slots][:, :, None]


def context_attention_ref(
    q,
    k_cache,
    v_cache,
    q_starts,
    q_lens,
    cached_lens,
    seq_lens,
    req_rows,
    req_table,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch, one request at a time, in fp32. Returns [T, Hq, D] in q's dtype.

    The causal mask, ALiBi and the window come from worker.model.positions.position_scores,
    the rule the model tests check against transformers. An FP8 pool is dequantised first.
    """
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_cache.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    for b in range(q_lens.shape[0]):
        start, n, cached, seq = (int(x[b]) for x in (q_starts, q_lens, cached_lens, seq_lens))
        slots = req_table[int(req_rows[b]), :seq].long()
        k = dequantized(k_cache, k_scale, slots).repeat_interleave(group, dim=1)  # [seq, Hq, D]
        v = dequantized(v_cache, v_scale, slots).repeat_interleave(group, dim=1)
        qb = q[start : start + n].float()  # [n, Hq, D]
        scores = torch.einsum("qhd,khd->qhk", qb, k) * scale  # [n, Hq, seq]
        rel = torch.arange(seq)[None, :] - (cached + torch.arange(n))[:, None]  # [n, seq]
        scores = position_scores(scores, rel.to(q.device), alibi_slopes, window)
        out[start : start + n] = torch.einsum("qhk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_attention_ref(
    q,
    k_cache,
    v_cache,
    req_rows,
    seq_lens,
    req_table,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain PyTorch in fp32, one request at a time. Returns [B, Hq, D] in q's dtype.
    ALiBi and the window: worker.model.positions.position_scores, as the model tests check it.
    An FP8 pool (k_scale / v_scale [S, Hkv]) is dequantised first: value x its token and head's scale."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.empty_like(q)
    for b in range(batch):
        slots = req_table[int(req_rows[b]), : int(seq_lens[b])].long()
        k = dequantized(k_cache, k_scale, slots).repeat_interleave(group, dim=1)  # [seq, Hq, D]
        v = dequantized(v_cache, v_scale, slots).repeat_interleave(group, dim=1)
        seq = slots.shape[0]
        scores = torch.einsum("hd,khd->hk", q[b].float(), k)[None] * scale  # [1, Hq, seq]
        rel = (torch.arange(seq, device=q.device) - (seq - 1))[None]  # [1, seq]: the query is the last token
        scores = position_scores(scores, rel, alibi_slopes, window)
        out[b] = torch.einsum("hk,khd->hd", scores[0].softmax(-1), v).to(q.dtype)
    return out
