"""y = x (W * s)^T (+ b) with W in FP8 and x in bf16/fp16, for more rows than the GEMV takes: W8A16.

``--quantization fp8_w8a16`` keeps every input as it comes. Above ``gemv.MAX_ROWS`` rows it converted
the whole FP8 weight to bf16 each call and ran cuBLAS on the copy: on an H100 the Llama-3-8B decode
steps of 16-63 requests took 27.7 ms against bf16's 8.2 (a full weight copy written and read back a
step), and the offline workload ran at 0.56x of bf16 (bench/RESULTS.md). Here a tiled matmul loads FP8
weight tiles (one byte a weight) and converts them to x's dtype in registers (exact), so the weight is
read once, at half bf16's bytes, and never copied; the column scales and the bias are applied to the
fp32 sums before the one store.

Tiles: ``BLOCK_M`` grows with the rows (32 / 64 / 128), so a decode step's few dozen rows are one or two
row tiles and a prefill's thousands fill the tensor cores; the programs run grouped by ``GROUP_M``
row tiles, so a weight tile is read from HBM about once and from L2 for the other row tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K, GROUP_M = 128, 64, 8


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    # Program p -> (row tile, column tile), GROUP_M row tiles at a time over every column tile.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_K] FP8, K contiguous as the GEMV reads it
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # FP8 -> x's dtype: exact
    acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_m(rows: int) -> int:
    return 32 if rows <= 32 else 64 if rows <= 64 else 128


def w8a16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), weight [N, K] FP8, weight_scale [N] fp32, bias [N] or None ->
    ``out`` [M, N] in x's dtype: x (weight * weight_scale[:, None])^T + bias, summed in fp32."""
    (rows, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and weight.element_size() == 1, f"weight {tuple(weight.shape)} {weight.dtype}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight_scale.shape == (n,) and weight_scale.stride(0) == 1
    assert weight_scale.dtype == torch.float32
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (rows, n) and out.dtype == x.dtype and out.stride(1) == 1
    if rows == 0:
        return out
    bm = block_m(rows)
    grid = (triton.cdiv(rows, bm) * triton.cdiv(n, BLOCK_N),)
    _w8a16_kernel[grid](
        x, weight, weight_scale, bias if bias is not None else weight_scale, out, rows, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M, num_warps=8 if bm == 128 else 4, num_stages=4 if bm < 128 else 3,
    )  # fmt: skip
    return out
