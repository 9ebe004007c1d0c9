"""A large decode batch's LoRA delta, y[t] += (x[t] A[s_t]^T) B[s_t]^T, over the tokens grouped by slot.

``bgmv`` gives each token a program of its own and reads its adapter's A and B for it alone: at a
batch of ~700 over 100 adapters of rank 16 on the Llama-3-8B shape every token re-reads its
adapter's 2.6 MB a layer, and the step took 66 ms against 31 without adapters on an H100
(bench/RESULTS.md, issue 32). Here, as a fused MoE kernel groups tokens by expert, the tokens are
laid out by slot in blocks of ``BLOCK_M`` (``group_tokens``: each slot's tokens padded to whole
blocks, so every block holds one slot), and a program multiplies one block by its slot's tile on
the tensor cores: each adapter's weights are read once a step per block of its tokens, not once
per token. The grouping is a handful of fixed-size tensor ops (a sort, a histogram, prefix sums,
a search), done once a forward (``AdapterSet.bind``), inside a captured decode graph too.

The shrink (v = x A^T, fp32) splits K as ``bgmv`` does, so a few hundred tokens still fill the
GPU; the splits are summed once before the expand. Slot 0 (no adapter, and a captured graph's
padded rows) gets no block: its rows of y are not touched. Every (token, output) is written by one
program: no atomics, the same result every run. Small batches stay on ``bgmv``
(``worker.lora.delta.GROUPED_FROM``): the grid is sized for the worst grouping, and at a few tokens
its idle programs cost more than the reads they save (bench.engine.lora_kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.model.kernels.lora_shards import Shards, block_ranks, expand_span

BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K = 16, 64, 128, 512


@dataclass(frozen=True)
class TokenGroups:
    tokens: torch.Tensor  # [blocks * block_m] int32: the token at each grouped position, -1 padding
    block_slots: torch.Tensor  # [blocks] int32: each block's slot; 0: an unused block (the grid's spare)
    block_m: int = BLOCK_M  # tokens a block (a power of two, >= 16: tl.dot's least)


def group_tokens(slots: torch.Tensor, num_slots: int, block_m: int = BLOCK_M) -> TokenGroups:
    """Tokens [T] of slots in [0, num_slots) laid out by slot in whole blocks of ``block_m`` (slot 0
    left out). Fixed sizes throughout (no host sync): the blocks are T / block_m plus one partial
    block for each slot that has tokens, at most min(T, num_slots - 1) of them."""
    t, dev = slots.shape[0], slots.device
    num_blocks = triton.cdiv(t, block_m) + min(t, num_slots - 1)
    slots = slots.long()
    counts = torch.zeros(num_slots, dtype=torch.long, device=dev).scatter_add_(0, slots, torch.ones_like(slots))
    blocks = (counts + block_m - 1) // block_m
    blocks[:1].zero_()  # no adapter: no block (a fill on the device: nothing copied in a graph's capture)
    block_end = torch.cumsum(blocks, 0)
    sorted_slots, order = torch.sort(slots, stable=True)
    first = torch.cumsum(counts, 0) - counts  # each slot's first index in the sorted order
    rank = torch.arange(t, device=dev) - first[sorted_slots]  # a token's place among its slot's
    place = (block_end - blocks)[sorted_slots] * block_m + rank
    place = place.masked_fill(sorted_slots == 0, num_blocks * block_m)  # slot 0: to the spare entry
    tokens = torch.full((num_blocks * block_m + 1,), -1, dtype=torch.int32, device=dev)
    tokens.scatter_(0, place, order.to(torch.int32))
    index = torch.arange(num_blocks, device=dev)
    block_slots = torch.searchsorted(block_end, index, right=True)  # the slot whose blocks hold it
    block_slots = block_slots.masked_fill(index >= block_end[-1], 0).to(torch.int32)
    return TokenGroups(tokens[:-1], block_slots, block_m)


@triton.jit
def _block_rows(tokens, blk, BM: tl.constexpr):
    """Block ``blk``'s grouped positions, the tokens there, and which are tokens (not padding)."""
    pos = blk * BM + tl.arange(0, BM)
    tok = tl.load(tokens + pos).to(tl.int64)
    return pos, tok, tok >= 0


@triton.jit
def _shrink(
    x, a, v, tokens, block_slots, K, R, s_x, s_as, s_ar, s_vs, s_v, CHUNK: tl.constexpr, BM: tl.constexpr,
    BR: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    blk, split = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slots + blk).to(tl.int64)
    if slot == 0:
        return
    pos, tok, ok = _block_rows(tokens, blk, BM)
    ranks = tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(split * CHUNK, split * CHUNK + CHUNK, BK):
        ks = k0 + tl.arange(0, BK)
        xs = tl.load(x + tok[:, None] * s_x + ks[None, :], mask=ok[:, None] & (ks[None, :] < K), other=0.0)
        a_ptr = a + slot * s_as + ranks[:, None] * s_ar + ks[None, :]
        at = tl.load(a_ptr, mask=(ranks[:, None] < R) & (ks[None, :] < K), other=0.0)  # [BR, BK]
        acc += tl.dot(xs, tl.trans(at))
    tl.store(v + split * s_vs + pos[:, None] * s_v + ranks[None, :], acc, mask=ok[:, None] & (ranks[None, :] < R))


@triton.jit
def _expand(
    v, b, y, tokens, block_slots, N, RS, END0, END1, s_v, s_bs, s_bn, s_y,
    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    blk, nb = tl.program_id(0), tl.program_id(1)
    slot = tl.load(block_slots + blk).to(tl.int64)
    if slot == 0:
        return
    pos, tok, ok = _block_rows(tokens, blk, BM)
    cols = nb * BN + tl.arange(0, BN)
    r0 = ((nb * BN >= END0).to(tl.int32) + (nb * BN >= END1).to(tl.int32)) * RS  # its shard's ranks (lora_shards)
    rs = tl.arange(0, BR)
    vs = tl.load(v + pos[:, None] * s_v + r0 + rs[None, :], mask=ok[:, None] & (rs[None, :] < RS), other=0.0)
    b_ptr = b + slot * s_bs + cols[:, None] * s_bn + r0 + rs[None, :]
    bt = tl.load(b_ptr, mask=(cols[:, None] < N) & (rs[None, :] < RS), other=0.0)  # [BN, BR]
    acc = tl.dot(vs.to(bt.dtype), tl.trans(bt))  # v in the weights' dtype: tensor cores, fp32 sums
    y_ptr = y + tok[:, None] * s_y + cols[None, :]
    mask = ok[:, None] & (cols[None, :] < N)
    out = tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(y_ptr, out.to(y.dtype.element_ty), mask=mask)


def bgmv_grouped(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    groups: TokenGroups,
    v: torch.Tensor | None = None,
    shards: Shards | None = None,
    block_n: int = BLOCK_N,
    split_k: int = SPLIT_K,
    warps: tuple[int, int] = (4, 4),
) -> torch.Tensor:
    """y [T, N] += each token's delta, in place; x [T, K], A [S, R, K], B [S, N, R], ``groups`` from
    ``group_tokens`` over the batch's slots. ``v``: the [cdiv(K, split_k), blocks * block_m, R] fp32
    scratch (tests pass a poisoned one). ``shards``: B is block diagonal so (``lora_shards``).
    ``block_n``, ``split_k``, ``warps``: the expand's output tile, the shrink's K per program, and the
    shrink's and expand's warps a program (a benchmark's sweep)."""
    (t, k), (num_slots, r, k_a), (_, n, r_b) = x.shape, a.shape, b.shape
    assert k_a == k and r_b == r and b.shape[0] == num_slots and y.shape == (t, n), (x.shape, a.shape, b.shape)
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype
    blocks = groups.block_slots.shape[0]
    if t == 0 or blocks == 0:
        return y
    splits, block_m = triton.cdiv(k, split_k), groups.block_m
    places = blocks * block_m
    v = torch.empty(splits, places, r, dtype=torch.float32, device=x.device) if v is None else v
    assert v.shape == (splits, places, r) and v.stride(2) == 1
    block_r = block_ranks(r)
    # fp32 tiles half as long: at rank 96 the pipelined [BR, BK] tiles asked 278 KB of shared memory, over an H100's 227
    block_k = BLOCK_K if a.element_size() <= 2 else BLOCK_K // 2
    _shrink[(blocks, splits)](
        x, a, v, groups.tokens, groups.block_slots, k, r, x.stride(0), a.stride(0), a.stride(1), v.stride(0),
        v.stride(1), CHUNK=split_k, BM=block_m, BR=block_r, BK=block_k, num_warps=warps[0],
    )  # fmt: skip
    total = v[0] if splits == 1 else v.sum(0)  # the splits added once (a fixed-order reduction)
    end0, end1, ranks = expand_span(shards, n, r, block_n)
    _expand[(blocks, triton.cdiv(n, block_n))](
        total, b, y, groups.tokens, groups.block_slots, n, ranks, end0, end1, total.stride(0), b.stride(0),
        b.stride(1), y.stride(0), BM=block_m, BN=block_n, BR=block_ranks(ranks), num_warps=warps[1],
    )  # fmt: skip
    return y
