"""y = x W^T (+ b) for a few rows of x: the decode step's matmuls at small batch.

At M <= 16 rows a matmul is a weight read: its time should be the weight's
bytes over HBM bandwidth. cuBLAS reached that for wide weights but only 0.47
of it for Llama-3-8B's qkv_proj (6144x4096) and 0.26 for o_proj (4096x4096)
on an H200 (bench/engine/gemv.py, RESULTS.md): too few tiles to keep 132 SMs
reading. Here each program reads a [BLOCK_N, K / SPLIT_K] slice of W
(K contiguous, so the reads coalesce), and enough programs run at once to
saturate HBM: ``cdiv(N, BLOCK_N) * SPLIT_K`` of them. With SPLIT_K > 1 the
programs write fp32 partial sums [SPLIT_K, M, N] and a second kernel adds
them (and the bias) in a fixed order: deterministic, unlike atomics, so
greedy decoding gives the same tokens run after run.

x's rows are padded to 16 inside the kernel (``tl.dot``'s minimum): the
padding costs tensor-core work that is free next to the weight read.

FP8 weights (``weight_scale`` given: W8A16, the small-batch path of
``worker.model.fp8.Fp8Linear`` on CUDA): each weight tile is converted to x's
dtype in registers (exact: every e4m3 value is a bf16 / fp16 value) and each
output column's sum is multiplied by its scale before it is written, so the
kernel reads one byte per weight and x needs no quantisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # one BLOCK_M tile; more rows go to cuBLAS


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def default_config(out_features: int, in_features: int, num_sms: int) -> GemvConfig:
    """Enough programs for about four per SM, each over at least 512 of K (measured in bench/engine/gemv.py)."""
    block_n, block_k = 32, 128
    tiles = triton.cdiv(out_features, block_n)
    split_k = 1
    while tiles * split_k < 4 * num_sms and in_features // (split_k * 2) >= 512:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k)


def fp8_config(out_features: int, in_features: int, num_sms: int) -> GemvConfig:
    """``default_config`` with BLOCK_K 256: the same bytes per weight row and step as bf16's 128."""
    config = default_config(out_features, in_features, num_sms)
    return GemvConfig(config.block_n, 256, max(1, config.split_k // 2), config.num_warps, config.num_stages)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    scale_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK_N), SPLIT_K): output columns [pid_n * BLOCK_N, +BLOCK_N) over
    # K in [pid_k * k_per_split, +k_per_split); k_per_split is a multiple of BLOCK_K.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if HAS_SCALE:
            w = w.to(x.dtype)  # FP8 -> x's dtype, exact
        acc += tl.dot(x, tl.trans(w))
    if HAS_SCALE:  # per output column; a split's partial sum scaled alike, as the sum is linear
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    b_ptr,
    out_ptr,
    N,
    SPLIT_K: tl.constexpr,
    stride_ps,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid (M, cdiv(N, BLOCK)): out[m, cols] = sum over splits in order (+ b), one rounding.
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + row * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig,
    out: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (M <= 16), weight [N, K], bias [N] or None -> out [M, N] in x's dtype.
    weight_scale [N] fp32: weight is FP8 and each output column is scaled by its entry."""
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    assert num_rows <= MAX_ROWS, f"{num_rows} rows: at most {MAX_ROWS}"
    assert weight.shape[1] == in_features and x.stride(1) == 1 and weight.stride(1) == 1
    if weight_scale is not None:
        assert weight_scale.shape == (weight.shape[0],) and weight_scale.dtype == torch.float32
        assert weight_scale.stride(0) == 1 and weight.element_size() == 1, "FP8 weight, contiguous fp32 scales"
    if out is None:
        out = torch.empty((num_rows, out_features), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, out_features) and out.dtype == x.dtype and out.stride(1) == 1
    if num_rows == 0:
        return out
    split_k = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(in_features, split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(in_features, k_per_split)  # no empty splits
    target = (
        out if split_k == 1 else torch.empty((split_k, num_rows, out_features), dtype=torch.float32, device=x.device)
    )
    grid = (triton.cdiv(out_features, config.block_n), split_k)
    _gemv_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        weight_scale if weight_scale is not None else x,  # x stands in: never read
        target,
        num_rows,
        out_features,
        in_features,
        k_per_split,
        x.stride(0),
        weight.stride(0),
        target.stride(0) if split_k > 1 else 0,
        target.stride(-2),
        HAS_BIAS=bias is not None and split_k == 1,
        HAS_SCALE=weight_scale is not None,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split_k > 1:
        block = min(1024, triton.next_power_of_2(out_features))
        _sum_splits_kernel[(num_rows, triton.cdiv(out_features, block))](
            target,
            bias if bias is not None else target,
            out,
            out_features,
            split_k,
            target.stride(0),
            out.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return out


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, weight_scale: torch.Tensor | None = None
) -> torch.Tensor:
    y = x.float() @ weight.float().T
    y = y if weight_scale is None else y * weight_scale[None, :]
    return (y if bias is None else y + bias.float()).to(x.dtype)
