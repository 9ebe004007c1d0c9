"""A large decode batch's LoRA delta, y[t] += (x[t] A[s_t]^T) B[s_t]^T, with the tokens sorted by slot.

``bgmv`` gives each token a program of its own and reads its adapter's A and B rows for it alone:
at a batch of ~700 over 100 adapters of rank 16 on the Llama-3-8B shape that is ~60 GB of weight
reads a step (every token re-reads its adapter's 2.6 MB a layer), and the step took 66 ms against
31 without adapters on an H100 (bench/RESULTS.md, issue 32). Here the tokens are taken in the
order of their slots (``lora_order``: a stable sort, done once a step, inside a captured graph
too), and a program takes a block of ``BLOCK_M`` consecutive sorted tokens: for each slot present
in its block (a few, since the block is sorted) it reads that adapter's tile once for all its
tokens and multiplies on the tensor cores, as SGMV does for a prefill's segments. Tokens of
other slots in the block are masked out of the product, so the sum is exact and each y row still
belongs to one program (no atomics, the same result every run).

The shrink (v = x A^T, fp32, in sorted order) splits K as ``bgmv`` does, so a few hundred tokens
still fill the GPU; the expand adds the splits up as it loads them. Slot 0 (no adapter, and a
captured graph's padded rows) is skipped and its rows of y are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K = 16, 64, 64, 512


def lora_order(slots: torch.Tensor) -> torch.Tensor:
    """[2, T] int32: the tokens' order by slot (stable) and their slots in that order."""
    sorted_slots, order = torch.sort(slots, stable=True)
    return torch.stack([order.to(torch.int32), sorted_slots.to(torch.int32)])


@triton.jit
def _block(order, T, BM: tl.constexpr):
    """This program's sorted positions, their tokens and slots, and the slots' range in the block."""
    pos = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = pos < T
    tokens = tl.load(order + pos, mask=ok, other=0).to(tl.int64)
    slots = tl.load(order + T + pos, mask=ok, other=0)
    first = tl.maximum(tl.min(tl.where(ok, slots, 2**30), axis=0), 1)  # slot 0 is skipped
    last = tl.max(tl.where(ok, slots, 0), axis=0)
    return pos, ok, tokens, slots, first, last


@triton.jit
def _shrink(
    x, a, v, order, T, K, R, s_x, s_as, s_ar, s_vs, s_v, CHUNK: tl.constexpr, BM: tl.constexpr, BR: tl.constexpr,
    BK: tl.constexpr,
):  # fmt: skip
    pos, ok, tokens, slots, first, last = _block(order, T, BM)
    split = tl.program_id(1)
    ranks = tl.arange(0, BR)
    for s in range(first, last + 1):
        mine = ok & (slots == s)
        if tl.sum(mine.to(tl.int32), axis=0) > 0:  # a slot between two present ones may have no token
            acc = tl.zeros((BM, BR), dtype=tl.float32)
            for k0 in range(split * CHUNK, split * CHUNK + CHUNK, BK):
                ks = k0 + tl.arange(0, BK)
                xs = tl.load(x + tokens[:, None] * s_x + ks[None, :], mask=mine[:, None] & (ks[None, :] < K), other=0.0)
                a_ptr = a + (tl.full((), 0, tl.int64) + s) * s_as + ranks[:, None] * s_ar + ks[None, :]
                at = tl.load(a_ptr, mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)  # [BR, BK]
                acc += tl.dot(xs, tl.trans(at))
            v_ptr = v + split * s_vs + pos[:, None] * s_v + ranks[None, :]
            tl.store(v_ptr, acc, mask=mine[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand(
    v, b, y, order, T, N, R, s_vs, s_v, s_bs, s_bn, s_y, SPLITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    BR: tl.constexpr,
):  # fmt: skip
    pos, ok, tokens, slots, first, last = _block(order, T, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rs = tl.arange(0, BR)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(first, last + 1):
        mine = ok & (slots == s)
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            vs = tl.zeros((BM, BR), dtype=tl.float32)
            for split in tl.static_range(SPLITS):  # the shrink's partial sums, always in this order
                v_ptr = v + split * s_vs + pos[:, None] * s_v + rs[None, :]
                vs += tl.load(v_ptr, mask=mine[:, None] & (rs[None, :] < R), other=0.0)
            b_ptr = b + (tl.full((), 0, tl.int64) + s) * s_bs + cols[:, None] * s_bn + rs[None, :]
            bt = tl.load(b_ptr, mask=(cols[:, None] < N) & (rs[None, :] < R), other=0.0)  # [BN, BR]
            acc += tl.dot(vs.to(bt.dtype), tl.trans(bt))  # rows of other slots are zeros here
    y_ptr = y + tokens[:, None] * s_y + cols[None, :]
    mask = (ok & (slots > 0))[:, None] & (cols[None, :] < N)
    out = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptr, out.to(y.dtype.element_ty), mask=mask)


def bgmv_sorted(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    order: torch.Tensor,
    v: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [T, N] += each token's delta, in place; x [T, K], A [S, R, K], B [S, N, R], ``order`` [2, T]
    from ``lora_order``. ``v``: the [splits, T, R] fp32 scratch (tests pass a poisoned one)."""
    (t, k), (num_slots, r, k_a), (_, n, r_b) = x.shape, a.shape, b.shape
    assert k_a == k and r_b == r and b.shape[0] == num_slots and y.shape == (t, n), (x.shape, a.shape, b.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    assert order.shape == (2, t) and order.is_contiguous() and a.dtype == b.dtype
    if t == 0:
        return y
    splits = triton.cdiv(k, SPLIT_K)
    v = torch.empty(splits, t, r, dtype=torch.float32, device=x.device) if v is None else v
    assert v.shape == (splits, t, r) and v.stride(2) == 1
    block_r = max(triton.next_power_of_2(r), 16)
    rows = triton.cdiv(t, BLOCK_M)
    _shrink[(rows, splits)](
        x, a, v, order, t, k, r, x.stride(0), a.stride(0), a.stride(1), v.stride(0), v.stride(1),
        CHUNK=SPLIT_K, BM=BLOCK_M, BR=block_r, BK=BLOCK_K,
    )  # fmt: skip
    _expand[(rows, triton.cdiv(n, BLOCK_N))](
        v, b, y, order, t, n, r, v.stride(0), v.stride(1), b.stride(0), b.stride(1), y.stride(0),
        SPLITS=splits, BM=BLOCK_M, BN=BLOCK_N, BR=block_r,
    )  # fmt: skip
    return y
