"""SGMV: a prefill's LoRA delta, y[t] += (x[t] A[s]^T) B[s]^T per segment of tokens sharing slot s.

A prefill step packs each request's new tokens together (``ForwardBatch``: request b's tokens are
q_starts[b] .. q_starts[b] + q_lens[b] - 1), so every request is a segment with one adapter
slot, as in Punica's and S-LoRA's segmented gather matmul. Two kernels:

- shrink: v [T, R] (fp32) = x A[s]^T, grid (segment, row block, rank block);
- expand: y [T, N] += v B[s]^T, grid (segment, row block, output block); each y tile belongs to
  one program, so the add needs no atomics and is deterministic.

Slot 0 is "no adapter" (``worker.lora.adapter_set``): its segments are skipped by both kernels
(v is neither written nor read there), so base requests cost nothing. Grids are sized by the
longest segment (``max_q_len``, a host integer the batch has anyway); blocks past a shorter
segment's end exit at once. The reference is ``worker.lora.delta.lora_delta_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.lora_shards import Shards, expand_span

BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R = 16, 64, 64, 16  # tl.dot needs every dim >= 16


@triton.jit
def _shrink(
    x, a, v, starts, lens, slots, K, R, s_x, s_as, s_ar, s_v, BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr
):
    seg, mb, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + seg).to(tl.int64)
    n = tl.load(lens + seg)
    if slot == 0 or mb * BM >= n:
        return
    rows = tl.load(starts + seg).to(tl.int64) + mb * BM + tl.arange(0, BM)
    row_ok = mb * BM + tl.arange(0, BM) < n
    ranks = rb * BR + tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        xs = tl.load(x + rows[:, None] * s_x + ks[None, :], mask=row_ok[:, None] & (ks[None, :] < K), other=0.0)
        a_ptr = a + slot * s_as + ranks[:, None] * s_ar + ks[None, :]
        at = tl.load(a_ptr, mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)  # [BR, BK]
        acc += tl.dot(xs, tl.trans(at))
    tl.store(v + rows[:, None] * s_v + ranks[None, :], acc, mask=row_ok[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand(
    v, b, y, starts, lens, slots, N, RS, END0, END1, s_v, s_bs, s_bn, s_y,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    seg, mb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + seg).to(tl.int64)
    n = tl.load(lens + seg)
    if slot == 0 or mb * BM >= n:
        return
    rows = tl.load(starts + seg).to(tl.int64) + mb * BM + tl.arange(0, BM)
    row_ok = mb * BM + tl.arange(0, BM) < n
    cols = nb * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    first = ((nb * BN >= END0).to(tl.int32) + (nb * BN >= END1).to(tl.int32)) * RS  # its shard's ranks (lora_shards)
    for r0 in range(0, RS, BR):
        rs = r0 + tl.arange(0, BR)
        v_ptr = v + rows[:, None] * s_v + first + rs[None, :]
        vs = tl.load(v_ptr, mask=row_ok[:, None] & (rs[None, :] < RS), other=0.0)
        b_ptr = b + slot * s_bs + cols[:, None] * s_bn + first + rs[None, :]
        bt = tl.load(b_ptr, mask=(cols[:, None] < N) & (rs[None, :] < RS), other=0.0)  # [BN, BR]
        acc += tl.dot(vs.to(bt.dtype), tl.trans(bt))  # v in the weights' dtype: tensor cores, fp32 sums
    y_ptr = y + rows[:, None] * s_y + cols[None, :]
    mask = row_ok[:, None] & (cols[None, :] < N)
    out = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptr, out.to(y.dtype.element_ty), mask=mask)


def sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    slots: torch.Tensor,
    max_q_len: int,
    v: torch.Tensor | None = None,
    shards: Shards | None = None,
) -> torch.Tensor:
    """y [T, N] += each segment's delta, in place; x [T, K], A [S, R, K], B [S, N, R], q_starts /
    q_lens / slots [B]. ``v``: the [T, R] fp32 scratch (tests pass a poisoned one). ``shards``: B is
    block diagonal so (``lora_shards``)."""
    (t, k), (num_slots, r, k_a), (_, n, r_b) = x.shape, a.shape, b.shape
    assert k_a == k and r_b == r and b.shape[0] == num_slots and y.shape == (t, n), (x.shape, a.shape, b.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert q_starts.shape == q_lens.shape == slots.shape and a.dtype == b.dtype
    if t == 0 or len(slots) == 0:
        return y
    v = torch.empty(t, r, dtype=torch.float32, device=x.device) if v is None else v
    assert v.shape == (t, r) and v.stride(1) == 1
    rows = triton.cdiv(max_q_len, BLOCK_M)
    _shrink[(len(slots), rows, triton.cdiv(r, BLOCK_R))](
        x, a, v, q_starts, q_lens, slots, k, r, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        BM=BLOCK_M, BR=BLOCK_R, BK=BLOCK_K,
    )  # fmt: skip
    end0, end1, ranks = expand_span(shards, n, r, BLOCK_N)
    _expand[(len(slots), rows, triton.cdiv(n, BLOCK_N))](
        v, b, y, q_starts, q_lens, slots, n, ranks, end0, end1, v.stride(0), b.stride(0), b.stride(1),
        y.stride(0), BM=BLOCK_M, BN=BLOCK_N, BR=BLOCK_R,
    )  # fmt: skip
    return y
