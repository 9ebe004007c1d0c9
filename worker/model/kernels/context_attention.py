"""Prefill attention over packed sequences, K/V gathered from the token pool.

FlashAttention-2 style: each program owns BLOCK_M queries of one request and
one query head, and streams that request's K/V in BLOCK_N tiles through the
request -> token table with a base-2 online softmax. Request b's new queries
sit at packed rows q_starts[b] .. q_starts[b] + q_lens[b] - 1 and have
positions cached_lens[b] + i, so query i sees pool positions
0 .. cached_lens[b] + i (causal, offset by the cached prefix): a chunked or
prefix-cached prefill needs nothing else. The new tokens' K/V must already be
in the pool (copy_kv runs first). GQA: query head h reads KV head h // group.

Position rules (worker.model.positions.position_scores), each a constexpr switch
so the Llama path compiles as before: ALiBi adds slope[h] * (key_pos -
query_pos) to the scores (BLOOM); a sliding window W hides keys at
key_pos <= query_pos - W (Mistral). With a window the block starts at its
first query's window edge and every tile is masked: a window wider than the
context (the common case) then costs one masked tile pass, no more.

FP8 pool (``k_scale`` / ``v_scale`` given): as in decode_attention, tiles load as
e4m3 and convert to q's dtype in registers; key scales multiply score columns
after the dot, value scales the probabilities before the second.

The input checks both attention kernels share are in ``attention_inputs``; the
PyTorch reference the tests check this kernel against is ``attention_reference``'s
``context_attention_ref``.
"""

from __future__ import annotations

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

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_pos,
    qk_scale,
    slope,
    window,
    slot_ptr,
    k_ptr,
    v_ptr,
    stride_ks,
    stride_vs,
    ks_ptr,
    vs_ptr,
    stride_kss,
    stride_vss,
    lo,
    hi,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online-softmax update over pool positions [lo, hi) of one request.

    MASKED=False: every position is visible to every query of the block, so no
    masks (most tiles). MASKED=True: the diagonal tiles, with the causal mask
    (and the window's, if any) and the hi bound; masked columns read slot 0, a
    valid row, and their V is masked to 0 so whatever the pool holds there
    cannot leak in. slope is ALiBi's, already in log2 units like qk.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        if MASKED:
            slots = tl.load(slot_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
        else:
            slots = tl.load(slot_ptr + offs_n).to(tl.int64)
        k = tl.load(k_ptr + slots[None, :] * stride_ks + offs_d[:, None])  # [D, BLOCK_N]
        if KV_FP8:  # a masked column's scale may be garbage: its score is masked below
            k_scale = tl.load(ks_ptr + slots * stride_kss)  # [BLOCK_N]
            qk = tl.dot(q, k.to(q.dtype)) * (k_scale * qk_scale)[None, :]  # [BLOCK_M, BLOCK_N], log2 units
        else:
            qk = tl.dot(q, k) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        rel = offs_n[None, :] - q_pos[:, None]  # key - query position, [BLOCK_M, BLOCK_N]
        if HAS_ALIBI:
            qk += slope * rel.to(tl.float32)
        if MASKED:
            visible = n_mask[None, :] & (rel <= 0)
            if HAS_WINDOW:
                visible = visible & (rel > -window)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptr + slots[:, None] * stride_vs + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptr + slots[:, None] * stride_vs + offs_d[None, :])  # [BLOCK_N, D]
        if KV_FP8:
            if MASKED:
                v_scale = tl.load(vs_ptr + slots * stride_vss, mask=n_mask, other=0.0)  # [BLOCK_N]
            else:
                v_scale = tl.load(vs_ptr + slots * stride_vss)
            acc = acc * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _context_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    q_starts_ptr,
    q_lens_ptr,
    cached_lens_ptr,
    seq_lens_ptr,
    req_rows_ptr,
    table_ptr,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    slopes_ptr,
    window,  # ALiBi slopes [Hq] fp32 and the window: read only when HAS_ALIBI / HAS_WINDOW
    ks_ptr,
    vs_ptr,  # an FP8 pool's scales [S, Hkv]: read only when KV_FP8
    stride_kss,
    stride_vss,
    stride_ksh,
    stride_vsh,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_table,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start_m = tl.program_id(2) * BLOCK_M
    q_len = tl.load(q_lens_ptr + b)
    # The grid is sized for the longest request; shorter ones stop here.
    if start_m >= q_len:
        return
    q_start = tl.load(q_starts_ptr + b).to(tl.int64)
    cached = tl.load(cached_lens_ptr + b)
    seq_len = tl.load(seq_lens_ptr + b)
    row = tl.load(req_rows_ptr + b).to(tl.int64)
    kv_h = h // GROUP

    offs_m = start_m + tl.arange(0, BLOCK_M)  # query index within the request
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_rows = q_start + offs_m
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :], mask=m_mask[:, None], other=0.0
    )  # [BLOCK_M, D]
    q_pos = cached + offs_m  # absolute position of each query

    # Finite init: a row whose first tile is fully masked gives exp2(-inf - m) = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    slot_ptr = table_ptr + row * stride_table
    k_head, v_head = k_ptr + kv_h * stride_kh, v_ptr + kv_h * stride_vh
    ks_head, vs_head = ks_ptr + kv_h * stride_ksh, vs_ptr + kv_h * stride_vsh
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + h) * 1.4426950408889634  # to log2 units, as qk_scale
    kv_end = tl.minimum(seq_len, cached + start_m + BLOCK_M)  # past the block's last query position
    if HAS_WINDOW:
        # Nothing before the first query's window edge is visible to the block.
        lo = tl.maximum(cached + start_m - window + 1, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            qk_scale,
            slope,
            window,
            slot_ptr,
            k_head,
            v_head,
            stride_ks,
            stride_vs,
            ks_head,
            vs_head,
            stride_kss,
            stride_vss,
            lo,
            kv_end,
            HEAD_DIM,
            BLOCK_N,
            True,
            HAS_ALIBI,
            HAS_WINDOW,
            KV_FP8,
        )
    else:
        # Positions <= cached + start_m are visible to every query of the block
        # (and < seq_len, as start_m < q_len): whole tiles of them need no mask.
        full_end = (cached + start_m + 1) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            qk_scale,
            slope,
            window,
            slot_ptr,
            k_head,
            v_head,
            stride_ks,
            stride_vs,
            ks_head,
            vs_head,
            stride_kss,
            stride_vss,
            0,
            full_end,
            HEAD_DIM,
            BLOCK_N,
            False,
            HAS_ALIBI,
            HAS_WINDOW,
            KV_FP8,
        )
        # The rest, up to the block's last query position: causal mask.
        acc, m_i, l_i = _attend_tiles(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            qk_scale,
            slope,
            window,
            slot_ptr,
            k_head,
            v_head,
            stride_ks,
            stride_vs,
            ks_head,
            vs_head,
            stride_kss,
            stride_vss,
            full_end,
            kv_end,
            HEAD_DIM,
            BLOCK_N,
            True,
            HAS_ALIBI,
            HAS_WINDOW,
            KV_FP8,
        )
    # Every valid row saw its own position, so l_i > 0 wherever the store is unmasked.
    if HAS_WINDOW:
        # Padding rows (past q_len) may see nothing inside their window: 0/0, never stored.
        l_i = tl.where(l_i > 0, l_i, 1.0)
    acc = acc / l_i[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        acc.to(o_ptr.dtype.element_ty),
        mask=m_mask[:, None],
    )


def launch_config(head_dim: int) -> dict:
    """Default tiles and warps, from a sweep on an H200 at D=128, bf16 (a module
    function so a tuning run can swap it). D <= 64 is untuned."""
    return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)


def context_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    cached_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    req_rows: torch.Tensor,
    req_table: torch.Tensor,
    max_q_len: int,
    sm_scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """o[T, Hq, D] = causal attention of q over the pool, per request (see module doc).

    k_cache / v_cache: [S, Hkv, D] views of one pool layer (pool[:, :Hkv], pool[:, Hkv:]).
    max_q_len (host int) sizes the grid; it must be >= every q_lens[b].
    alibi_slopes [Hq] fp32 / window: the position rules, None for none.
    k_scale / v_scale: [S, Hkv] fp32 of an FP8 pool (None: the pool is in q's dtype).
    """
    index_tensors = (q_starts, q_lens, cached_lens, seq_lens, req_rows)
    check_pool_inputs(q, k_cache, v_cache, o, index_tensors, req_table)
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    check_position_rules(q, alibi_slopes, window)
    num_heads, head_dim = q.shape[1:]  # q: [T, Hq, D]
    batch = q_lens.shape[0]
    if batch == 0 or max_q_len == 0:
        return
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    cfg = launch_config(head_dim)  # {BLOCK_M, BLOCK_N, num_warps, num_stages}
    tile_m, tile_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_m, block_n = block_m or tile_m, block_n or tile_n
    grid = (batch, num_heads, triton.cdiv(max_q_len, block_m))
    _context_attention_kernel[grid](
        q, k_cache, v_cache, o, q_starts, q_lens, cached_lens, seq_lens, req_rows, req_table, scale * LOG2E,
        q if alibi_slopes is None else alibi_slopes,  # q stands in for what is off: never read, a tensor either way
        window or 0, q if k_scale is None else k_scale, q if v_scale is None else v_scale,
        *scale_strides(k_scale, v_scale), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), o.stride(0), o.stride(1), req_table.stride(0),
        GROUP=num_heads // k_cache.shape[1], HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_ALIBI=alibi_slopes is not None, HAS_WINDOW=window is not None, KV_FP8=k_scale is not None, **cfg,
    )  # fmt: skip
