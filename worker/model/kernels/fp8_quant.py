"""Dynamic per-token FP8 quantisation of a linear layer's input: x [T, K] -> (q FP8 [T, K], scale [T]).

One program per row, two passes over it in BLOCK_K pieces: the row's amax, then
q = clamp(x / scale, +-448) cast to e4m3 (round to nearest even), with
scale = max(amax / 448, FP8_MIN_SCALE) in fp32: the operations of
``worker.model.ops.quantize_rows``, the reference, so the two agree to the bit
wherever both round the same quotient. The second pass re-reads the row (at most
K * 2 bytes, from L2 for the rows a program just read).

Triton's CPU interpreter (the CPU tests) casts fp32 to e4m3 wrongly: it rounds half
up and drops the carry when the mantissa rounds over (31.1 becomes 16, not 32). Under
it the quantisers round in fp32 first (``round_to_e4m3``), so the cast is exact; on a
GPU the hardware's cast (``cvt.rn.satfinite``) rounds, as torch's does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from worker.model.quant import FP8, FP8_MAX, FP8_MIN_SCALE, QuantizedRows

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@triton.jit
def round_to_e4m3(x):
    """x fp32 (|x| <= 448) rounded to the nearest e4m3 value, ties to even, still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal e4m3 values keep 3 of fp32's 23 mantissa bits: the integer add rounds to nearest
    # even and carries into the exponent when the mantissa rounds over.
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576: ~0xFFFFF
    # Below 2^-6 (e4m3's subnormals) the step is 2^-9: 1.5 * 2^23 added and taken away rounds
    # |x| * 512 to an integer, ties to even; the sign put back from the bits (-0.0 stays -0.0).
    sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) / 512.0
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def fp8_scale(amax, FP8_LIMIT: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's (or head's) scale from its amax: max(amax / 448, MIN_SCALE). div_rn: IEEE division, as
    torch's (Triton's '/' may be the faster approximate one on a GPU). Every quantising kernel's rule."""
    return tl.maximum(tl.math.div_rn(amax, FP8_LIMIT), MIN_SCALE)


@triton.jit
def fp8_values(x, scale, FP8_LIMIT: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """x / scale clamped to +-448, in fp32 (rounded to e4m3 already under the interpreter, ROUND_FIRST):
    what the caller casts to e4m3 as it stores."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
    if ROUND_FIRST:
        q = round_to_e4m3(q)
    return q


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_x,
    stride_q,
    FP8_LIMIT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = fp8_scale(tl.max(amax, 0), FP8_LIMIT, MIN_SCALE)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = fp8_values(x, scale, FP8_LIMIT, ROUND_FIRST)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (rows may be strided, K contiguous) -> (q [T, K] FP8, scale [T] fp32)."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x {tuple(x.shape)}: want [T, K], K contiguous"
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block_k = block_k or min(4096, triton.next_power_of_2(k))
    _quantize_rows_kernel[(rows,)](
        x,
        q,
        scale,
        k,
        x.stride(0),
        q.stride(0),
        FP8_LIMIT=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        BLOCK_K=block_k,
        ROUND_FIRST=INTERPRETED,
        num_warps=4 if block_k <= 2048 else 8,
    )
    return q, scale


def fp8_rows(x: torch.Tensor, columns: int | None = None) -> QuantizedRows:
    """Room for x's rows (``columns`` of them, x's by default) quantised: what the ``*_fp8`` kernels fill."""
    rows = x.shape[0]
    q = torch.empty((rows, columns or x.shape[1]), dtype=FP8, device=x.device)
    return QuantizedRows(q, torch.empty(rows, dtype=torch.float32, device=x.device), x.dtype)
