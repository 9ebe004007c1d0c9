"""BGMV: a decode step's LoRA delta, y[t] += (x[t] A[s_t]^T) B[s_t]^T, each token its own slot.

A decode has one token per request, each possibly a different adapter: a segment of one row
would waste 15 of tl.dot's 16 rows, so (as Punica's BGMV) each program takes one token and a
block of outputs and multiplies on the CUDA cores: the work is the A and B rows' read, which
small ranks keep short. Two kernels, shrink (v = x A^T) and expand (y += v B^T), grids (token,
K split) and (token, output block). The shrink splits K (the input features, 4,096 to 14,336)
into chunks of ``SPLIT_K`` each a program of its own, writing partial sums v [splits, T, R] fp32
that the expand adds up as it loads them (in a fixed order: no atomics, the same result every
run). One program a token walking all of K was a chain of dependent loads on one SM: on an
H100, 100 adapters of rank 16 on the Llama-3-8B shape, a decode step of ~5 requests took 16.6 ms
against 6.9 without adapters (bench/RESULTS.md, issue 32).

Graph-safe: the slots are read on the device, grids depend only on T, R and N (fixed for a
captured batch size), and the scratch comes from the caller's stream. Slot 0 (no adapter, and
every padded row of a captured graph) returns at once. Reference: ``worker.lora.delta.lora_delta_ref``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.lora_shards import Shards, block_ranks, expand_span

BLOCK_N, BLOCK_K, SPLIT_K = 64, 128, 512


def shrink_splits(k: int, split_k: int = SPLIT_K) -> int:
    """How many programs share a token's K in the shrink: the first dimension of its scratch."""
    return triton.cdiv(k, split_k)


@triton.jit
def _shrink(x, a, v, slots, K, R, s_x, s_as, s_ar, s_vs, s_v, CHUNK: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    t, split = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot == 0:
        return
    ranks = tl.arange(0, BR)  # the whole rank in one block (BR = next power of two of R)
    acc = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(split * CHUNK, split * CHUNK + CHUNK, BK):
        ks = k0 + tl.arange(0, BK)
        xs = tl.load(x + t * s_x + ks, mask=ks < K, other=0.0).to(tl.float32)  # [BK]
        a_ptr = a + slot * s_as + ranks[:, None] * s_ar + ks[None, :]
        at = tl.load(a_ptr, mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0).to(tl.float32)  # [BR, BK]
        acc += tl.sum(at * xs[None, :], axis=1)
    tl.store(v + split * s_vs + t * s_v + ranks, acc, mask=ranks < R)


@triton.jit
def _expand(
    v, b, y, slots, N, RS, END0, END1, s_vs, s_v, s_bs, s_bn, s_y,
    SPLITS: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    t, nb = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot == 0:
        return
    cols = nb * BN + tl.arange(0, BN)
    r0 = ((nb * BN >= END0).to(tl.int32) + (nb * BN >= END1).to(tl.int32)) * RS  # its shard's ranks (lora_shards)
    rs = tl.arange(0, BR)
    vs = tl.zeros((BR,), dtype=tl.float32)
    for split in tl.static_range(SPLITS):  # the shrink's partial sums, always in this order
        vs += tl.load(v + split * s_vs + t * s_v + r0 + rs, mask=rs < RS, other=0.0)  # [BR] fp32
    b_ptr = b + slot * s_bs + cols[:, None] * s_bn + r0 + rs[None, :]
    bt = tl.load(b_ptr, mask=(cols[:, None] < N) & (rs[None, :] < RS), other=0.0).to(tl.float32)  # [BN, BR]
    delta = tl.sum(bt * vs[None, :], axis=1)
    y_ptr = y + t * s_y + cols
    out = tl.load(y_ptr, mask=cols < N, other=0.0).to(tl.float32) + delta
    tl.store(y_ptr, out.to(y.dtype.element_ty), mask=cols < N)


def bgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    v: torch.Tensor | None = None,
    shards: Shards | None = None,
    block_n: int = BLOCK_N,
    split_k: int = SPLIT_K,
) -> torch.Tensor:
    """y [T, N] += each token's delta, in place; x [T, K], A [S, R, K], B [S, N, R], slots [T].
    ``v``: the [shrink_splits(K, split_k), T, R] fp32 scratch of partial sums (tests pass a poisoned one).
    ``shards``: B is block diagonal so (``lora_shards``). ``block_n``, ``split_k``: the expand's output
    tile and the shrink's K per program (a benchmark's sweep)."""
    (t, k), (num_slots, r, k_a), (_, n, r_b) = x.shape, a.shape, b.shape
    assert k_a == k and r_b == r and b.shape[0] == num_slots and y.shape == (t, n), (x.shape, a.shape, b.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert slots.shape == (t,) and a.dtype == b.dtype
    if t == 0:
        return y
    splits = shrink_splits(k, split_k)
    v = torch.empty(splits, t, r, dtype=torch.float32, device=x.device) if v is None else v
    assert v.shape == (splits, t, r) and v.stride(2) == 1
    block_r = block_ranks(r)
    block_k = min(BLOCK_K, max(16, 4096 // block_r))  # an [R, K] tile of A at most 4,096 values
    _shrink[(t, splits)](
        x, a, v, slots, k, r, x.stride(0), a.stride(0), a.stride(1), v.stride(0), v.stride(1),
        CHUNK=split_k, BR=block_r, BK=block_k,
    )  # fmt: skip
    end0, end1, ranks = expand_span(shards, n, r, block_n)
    _expand[(t, triton.cdiv(n, block_n))](
        v, b, y, slots, n, ranks, end0, end1, v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0),
        SPLITS=splits, BN=block_n, BR=block_ranks(ranks),
    )  # fmt: skip
    return y
