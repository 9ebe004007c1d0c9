"""y = x (W * s)^T (+ b) with W in FP8 and x in bf16/fp16, for more rows than the GEMV takes: W8A16.

``--quantization fp8_w8a16`` keeps every input as it comes. Above ``gemv.MAX_ROWS`` rows it converted
the whole FP8 weight to bf16 each call and ran cuBLAS on the copy: on an H100 the Llama-3-8B decode
steps of 16-63 requests took 27.7 ms against bf16's 8.2 (a full weight copy written and read back a
step), and the offline workload ran at 0.56x of bf16 (bench/RESULTS.md). Here a tiled matmul loads FP8
weight tiles (one byte a weight) and converts them to x's dtype in registers (exact), so the weight is
read once, at half bf16's bytes, and never copied; the column scales and the bias are applied to the
fp32 sums before the one store.

Large M (above ``SMALL_ROWS``): ``BLOCK_M`` grows with the rows (32 / 64 / 128) so a prefill's
thousands of rows fill the tensor cores; the programs run grouped by ``GROUP_M`` row tiles, so a weight
tile is read from HBM about once and from L2 for the other row tiles.

Small M (17..256 rows, a decode step): the call is a weight read and should beat bf16 cuBLAS, whose
weight is twice the bytes. With the large-M tiles it did not: on one H100 (bench/engine/w8a16_gemm.py,
Llama-3-8B, µs, bf16 cuBLAS vs this kernel) o_proj took 21.8 vs 75.1 at M=32 and 30.0 vs 97.2 at
M=138, down_proj 57.8 vs 186.8 and 63.7 vs 261.3, qkv_proj 35.8 vs 96.9 at M=138. Two causes:
- Too few programs: one row tile times cdiv(N, 128) column tiles is 32 programs for o_proj at M=32 on
  132 SMs, too few reads in flight to saturate HBM. So ``small_rows_config`` aims at two programs per SM,
  both resident (``SMEM_BUDGET``): column tiles of 64, then split-K: ``SPLIT_K`` programs over K chunks
  write fp32 partial sums [SPLIT_K, M, N] that gemv's reduce kernel adds in a fixed order (+ bias):
  deterministic, unlike atomics. The split is capped so the partial sums (written and read back, 8
  bytes an output a split) stay under half the weight's bytes.
- The operand order: compiled for sm_90, x @ W^T with the converted weight as wgmma's B operand stores
  each converted tile to shared memory and fences before the wgmma (B must come from shared memory),
  and at BLOCK_M 32 it is no wgmma at all (its M is 64 a warp group: Ampere's mma instead). Swapped
  (``SWAP_AB``: y^T = W x^T) the FP8 tile is pipelined into shared memory, converted in registers and
  fed to wgmma as its A operand, which may come from registers; x's rows become wgmma's N (8..256).
The split-K path, the smaller tiles and the swapped order are in the kernel and pass its tests on an
H100, but the default is still the first tiles at every row count: the tuner's partial run there
(2026-12-06) found ``small_rows_config`` beaten by other configs and every config 1.7-2.4x bf16 cuBLAS
(bench/RESULTS.md). ``config=`` overrides it; bench/engine/w8a16_tune.py sweeps configs on a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.model.kernels.gemv import _sum_splits_kernel  # the GEMV's ordered split-K reduce, as is

GROUP_M = 8
SMALL_ROWS = 256  # up to here a call is a weight read (a decode step): the small-M config
MIN_K_PER_SPLIT = 512  # shorter chunks: more pipeline prologue and partial sums per weight byte (untuned)
# Bytes of pipeline buffers a program: two programs fit on an SM (an H100 has 228 KiB of shared memory
# an SM), so one's loads are in flight while the other computes or waits.
SMEM_BUDGET = 100 * 1024


@dataclass(frozen=True)
class W8A16Config:
    """A launch: tiles, K chunks (``split_k`` > 1: partial sums, then the reduce), Triton's warps and
    pipeline stages, and the operand order (``swap_ab``: W x^T, see the module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = False


@triton.jit(do_not_specialize=["M"])  # any row count: one compiled kernel per config, not per M % 16
def _w8a16_kernel(
    x_ptr, w_ptr, scale_ptr, b_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn, stride_os, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    # Grid (row tiles * column tiles, splits). Program (p, s) -> (row tile, column tile), GROUP_M row
    # tiles at a time over every column tile, summing K in [s * k_per_split, +k_per_split) into split
    # s's slice of out (stride_os; 0 without split-K). k_per_split is a multiple of BLOCK_K.
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
    k_start = tl.program_id(1) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(x.dtype)  # [BLOCK_N, BLOCK_K] FP8, K contiguous as the GEMV reads it; -> x's dtype: exact
        if SWAP_AB:  # the converted weight as the A operand, which wgmma can take from registers
            acc += tl.dot(w, tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w))
    if SWAP_AB:
        acc = tl.trans(acc)
    # Per output column; a split's partial sum scaled alike, as the sum is linear.
    acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def block_m(rows: int) -> int:
    return 32 if rows <= 32 else 64 if rows <= 64 else 128


def num_stages(bm: int, bn: int, bk: int, x_bytes: int = 2) -> int:
    """Pipeline depth whose x and weight tiles fit ``SMEM_BUDGET``, at most 4; 0 when not even 2 fit."""
    stages = min(4, SMEM_BUDGET // (bm * bk * x_bytes + bn * bk))
    return stages if stages >= 2 else 0


def default_config(rows: int, n: int, k: int, num_sms: int, x_bytes: int = 2) -> W8A16Config:
    """The tiles measured first, at every row count (see ``small_rows_config`` for why not that one)."""
    bm = block_m(rows)
    return W8A16Config(bm, 128, 64, 1, 8 if bm == 128 else 4, 4 if bm < 128 else 3)


@functools.lru_cache(maxsize=4096)
def small_rows_config(rows: int, n: int, k: int, num_sms: int, x_bytes: int = 2) -> W8A16Config:
    """The tuner's candidate for 17..256 rows: two programs per SM (module docstring). Not the default:
    on an H100 (2026-12-06, bench/engine/w8a16_tune.py, weights rotated past L2) it lost to other
    configs where it was timed (o_proj at 32 rows: 126.5 µs against 72.8 for 32-column tiles without a
    split; bf16 40.0), and all of them stayed 1.7-2.4x bf16 cuBLAS: a table from a whole tuner run is
    what should replace the default, not this guess."""
    bm = block_m(rows)
    if rows > SMALL_ROWS:
        return default_config(rows, n, k, num_sms, x_bytes)
    target, tiles_m = 2 * num_sms, triton.cdiv(rows, bm)
    bn = 128 if tiles_m * triton.cdiv(n, 128) >= target else 64
    tiles = tiles_m * triton.cdiv(n, bn)
    # Each split over >= MIN_K_PER_SPLIT of K, the partial sums (S * rows * n * 8 bytes) <= n * k / 2.
    most = max(1, min(k // MIN_K_PER_SPLIT, k // (16 * rows)))
    split = min(triton.cdiv(target, tiles), most)
    bk = 128 if bm <= 64 else 64  # 128 rows of x at BLOCK_K 128 would leave room for two stages only
    stages = max(2, num_stages(bm, bn, bk, x_bytes))
    return W8A16Config(bm, bn, bk, split, 8 if bm * bn >= 128 * 128 else 4, stages, swap_ab=True)


def splits(config: W8A16Config, k: int) -> tuple[int, int]:
    """(K per split, a multiple of BLOCK_K; the number of splits, none of them empty)."""
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def programs(config: W8A16Config, rows: int, n: int, k: int) -> int:
    """How many programs a call launches: row tiles x column tiles x splits."""
    return triton.cdiv(rows, config.block_m) * triton.cdiv(n, config.block_n) * splits(config, k)[1]


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def w8a16_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    config: W8A16Config | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32), weight [N, K] FP8, weight_scale [N] fp32, bias [N] or None ->
    ``out`` [M, N] in x's dtype: x (weight * weight_scale[:, None])^T + bias, summed in fp32.
    ``config``: the tiles, split and launch settings (default: ``default_config``)."""
    (rows, k), n = x.shape, weight.shape[0]
    assert weight.shape[1] == k and weight.element_size() == 1, f"weight {tuple(weight.shape)} {weight.dtype}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight_scale.shape == (n,) and weight_scale.stride(0) == 1
    assert weight_scale.dtype == torch.float32
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (rows, n) and out.dtype == x.dtype and out.stride(1) == 1
    if rows == 0:
        return out
    c = config or default_config(rows, n, k, _num_sms(x.device), x.element_size())
    k_per_split, split_k = splits(c, k)
    target = out if split_k == 1 else torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, c.block_m) * triton.cdiv(n, c.block_n), split_k)
    _w8a16_kernel[grid](
        x, weight, weight_scale, bias if bias is not None and split_k == 1 else weight_scale, target, rows, n, k,
        k_per_split, x.stride(0), weight.stride(0), target.stride(0) if split_k > 1 else 0, target.stride(-2),
        HAS_BIAS=bias is not None and split_k == 1, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=GROUP_M, SWAP_AB=c.swap_ab, num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    if split_k > 1:  # sum the splits in order (+ bias), one rounding to x's dtype
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(rows, triton.cdiv(n, block))](
            target, bias if bias is not None else target, out, n, split_k, target.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out
