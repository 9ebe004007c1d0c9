"""Decode attention (one query per request) over the token pool, split-K.

Flash-decoding in two launches:
  stage 1, grid (B, Hkv, num_splits): program (b, g, s) attends every query
    head of KV group g over positions [s * split_len, (s + 1) * split_len) of
    request b. The group's heads are one tl.dot operand, padded to >= 16 rows,
    so each K/V tile is loaded once per group, not once per query head. It
    writes a normalised partial output and its base-2 log-sum-exp.
  stage 2, grid (B, Hq): merges the partials of the splits request b uses.
  With one split (large batches) stage 1 writes o itself and stage 2 is not launched.
Splitting the sequence keeps the GPU busy when B * Hkv is small and contexts
are long; splits past a request's length exit at once.

Host ints, fixed at CUDA-graph capture: B, Hq, Hkv, D, max_seq_len and,
derived from them, num_splits and split_len. Everything per request
(seq_lens, req_rows, req_table) is read on the device, so a captured graph
stays valid while every seq_lens[b] <= the max_seq_len it was captured with.
A longer request would silently lose its tail (stage 2 clamps to num_splits
rather than read out of bounds), so capture at the longest allowed context.

Position rules (worker.model.positions.position_scores), constexpr switches so the
Llama path compiles as before: ALiBi adds slope[h] * (key_pos - query_pos),
the query sitting at seq_len - 1 (BLOOM); a sliding window W keeps only the
last W positions, so stage 1 starts at seq_len - W and splits wholly before
it exit at once, and stage 2 merges only the splits from there on (Mistral).

FP8 pool (``k_scale`` / ``v_scale`` given, ``worker.model.kv_cache``): K and V
tiles are loaded as e4m3 (half the bytes) and converted to q's dtype in registers
(exact); a key's scale multiplies its score column after the dot, a value's
scale its probability before the second dot, so no dequantised tile is formed.

The split choice and stage 1's tiles are in ``decode_launch``; the PyTorch
reference the tests check this kernel against is ``attention_reference``'s
``decode_attention_ref``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from worker.model.kernels.attention_inputs import (
    check_kv_scales,
    check_pool_inputs,
    check_position_rules,
    scale_strides,
)
from worker.model.kernels.decode_launch import FP8_POOL_TILES, Stage1Tiles, choose_splits

LOG2E = 1.4426950408889634


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    req_rows_ptr,
    seq_lens_ptr,
    table_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,
    split_len,
    slopes_ptr,
    window,
    ks_ptr,
    vs_ptr,
    stride_kss,
    stride_vss,
    stride_ksh,
    stride_vsh,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_table,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    KV_FP8: tl.constexpr,
    KV_F16: tl.constexpr,
    DIRECT: tl.constexpr,
):
    # HEAD_MAJOR: grid (Hkv, B, splits), so a request's KV groups run side by side and read the
    # same pool rows (K and V of every head share a row) at about the same time.
    b = tl.program_id(1 if HEAD_MAJOR else 0)
    g = tl.program_id(0 if HEAD_MAJOR else 1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    split_start = s * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if HAS_WINDOW:
        split_start = tl.maximum(split_start, seq_len - window)  # positions before it left the window
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < GROUP  # rows past the group are padding for tl.dot
    heads = g * GROUP + offs_h
    offs_d = tl.arange(0, HEAD_DIM)
    base = b.to(tl.int64) * stride_pb + heads * stride_ph + s * stride_ps  # [BLOCK_H]
    # Grid sized for max_seq_len: splits past this request's end (or before its window) have no work.
    if split_start >= split_end:
        if DIRECT:  # a padding request (seq_len 0) of a captured batch: zeros, as stage 2 would write
            tl.store(
                part_o_ptr + base[:, None] + offs_d[None, :],
                tl.zeros([BLOCK_H, HEAD_DIM], part_o_ptr.dtype.element_ty),
                mask=h_mask[:, None],
            )
        return
    row = tl.load(req_rows_ptr + b).to(tl.int64)

    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )  # [BLOCK_H, D]
    if KV_FP8 and KV_F16:  # the dots in fp16: e4m3 -> fp16 is one hardware conversion for two values
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if HAS_ALIBI:
        # log2 units, as qk_scale; padding rows get slope 0 (their output is never stored).
        slopes = tl.load(slopes_ptr + heads, mask=h_mask, other=0.0) * 1.4426950408889634  # [BLOCK_H]

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < split_end
        # Masked columns read slot 0, a valid pool row; their scores are masked below.
        slots = tl.load(table_ptr + row * stride_table + offs_n, mask=n_mask, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + slots[None, :] * stride_ks + g * stride_kh + offs_d[:, None], mask=n_mask[None, :], other=0.0
        )  # [D, BLOCK_N]
        if KV_FP8:
            k_scale = tl.load(ks_ptr + slots * stride_kss + g * stride_ksh, mask=n_mask, other=0.0)  # [BLOCK_N]
            qk = tl.dot(q, k.to(q.dtype)) * (k_scale * qk_scale)[None, :]  # [BLOCK_H, BLOCK_N], log2 units
        else:
            qk = tl.dot(q, k) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        if HAS_ALIBI:
            qk += slopes[:, None] * (offs_n - (seq_len - 1)).to(tl.float32)[None, :]
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vs + g * stride_vh + offs_d[None, :], mask=n_mask[:, None], other=0.0
        )  # [BLOCK_N, D]
        if KV_FP8:  # q's dtype: fp16 with KV_F16
            v_scale = tl.load(vs_ptr + slots * stride_vss + g * stride_vsh, mask=n_mask, other=0.0)  # [BLOCK_N]
            acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # The split holds >= 1 position, so l_i > 0. DIRECT: part_o is o itself, in q's dtype.
    out = acc / l_i[:, None]
    tl.store(part_o_ptr + base[:, None] + offs_d[None, :], out.to(part_o_ptr.dtype.element_ty), mask=h_mask[:, None])
    if not DIRECT:
        tl.store(part_lse_ptr + b.to(tl.int64) * stride_lb + heads * stride_lh + s, m_i + tl.log2(l_i), mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    o_ptr,
    split_len,
    num_splits,
    window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    # Only the splits stage 1 wrote; the clamp guards a seq_len past max_seq_len.
    num_used = tl.minimum(tl.cdiv(seq_len, split_len), num_splits)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_used
    if HAS_WINDOW:
        s_mask = s_mask & (offs_s >= tl.maximum(seq_len - window, 0) // split_len)
    offs_d = tl.arange(0, HEAD_DIM)
    lse = tl.load(
        part_lse_ptr + b.to(tl.int64) * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf")
    )  # [BLOCK_S]
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no split used: avoid -inf - -inf
    weight = tl.where(s_mask, tl.exp2(lse - lse_max), 0.0)
    part = tl.load(
        part_o_ptr + b.to(tl.int64) * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )  # [BLOCK_S, D]
    total = tl.sum(weight, 0)
    # seq_len == 0 (a padding request) has no split: write zeros, not NaN.
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: few programs, fast tests
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    req_table: torch.Tensor,
    max_seq_len: int,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
    num_splits: int | None = None,
    tiles: Stage1Tiles | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """o[B, Hq, D] = attention of request b's one query over its first seq_lens[b] pool tokens.

    k_cache / v_cache: [S, Hkv, D] views of one pool layer. max_seq_len (host
    int, >= every seq_lens[b]) sizes the split grid; no host sync happens here.
    alibi_slopes [Hq] fp32 / window: the position rules, None for none.
    k_scale / v_scale: [S, Hkv] fp32 of an FP8 pool (None: the pool is in q's dtype).
    """
    check_pool_inputs(q, k_cache, v_cache, o, (req_rows, seq_lens), req_table)
    assert req_rows.shape[0] == q.shape[0], f"{req_rows.shape[0]} requests, q has {q.shape[0]} rows: want one each"
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    check_position_rules(q, alibi_slopes, window)
    batch, num_heads, head_dim = q.shape  # q: [B, Hq, D]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if batch == 0:
        return
    tiles = tiles or (FP8_POOL_TILES if k_scale is not None else Stage1Tiles())
    if num_splits is None:
        num_splits, split_len = choose_splits(batch, num_kv_heads, max_seq_len, _num_sms(q.device), tiles.block_n)
    else:
        split_len = triton.cdiv(max(1, max_seq_len), num_splits)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    # One split (every large batch: B * Hkv programs fill the card) needs no merge: stage 1 writes o
    # itself, and neither the fp32 partials nor stage 2's pass over them exist.
    direct = num_splits == 1
    if direct:
        part_o, part_strides, part_lse, lse_strides = o, (o.stride(0), o.stride(1), 0), q, (0, 0)
    else:
        part_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part_o.stride()[:3], part_lse.stride()[:2]
    grid = (num_kv_heads, batch, num_splits) if tiles.head_major else (batch, num_kv_heads, num_splits)
    _decode_stage1_kernel[grid](
        q, k_cache, v_cache, req_rows, seq_lens, req_table, part_o, part_lse, scale * LOG2E, split_len,
        q if alibi_slopes is None else alibi_slopes,  # q stands in for what is off: never read, a tensor either way
        window or 0, q if k_scale is None else k_scale, q if v_scale is None else v_scale,
        *scale_strides(k_scale, v_scale), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_table.stride(0), *part_strides, *lse_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=tiles.block_n,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=window is not None, HEAD_MAJOR=tiles.head_major,
        KV_FP8=k_scale is not None, KV_F16=tiles.fp16_dot, DIRECT=direct, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )  # fmt: skip
    if direct:
        return
    _decode_stage2_kernel[(batch, num_heads)](
        part_o, part_lse, seq_lens, o, split_len, num_splits, window or 0, *part_o.stride()[:3],
        *part_lse.stride()[:2], o.stride(0), o.stride(1), HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), HAS_WINDOW=window is not None, num_warps=4,
    )  # fmt: skip
