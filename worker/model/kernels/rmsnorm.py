"""RMSNorm, plain and fused with the residual add that precedes it.

Fused: s = x + residual (rounded to the model dtype, as the unfused model
keeps it); residual_out = s; y = s * rsqrt(mean(s^2) + eps) * w. The
variance and the scaling run in fp32 and round once at the end (HF Llama
rounds before multiplying by w; the difference is within one ulp of the
dtype). One program per row, whole row in registers: rows are the hidden
size (4096 for Llama-3-8B), far below what fits.

``*_fp8``: the same norm, its output quantised per token for the FP8 linear
after it (``worker.model.quant.QuantizedRows``) in the same program, where the
row is already in registers: y rounded to the model dtype, then exactly the
operations of ``kernels.fp8_quant`` (the two agree to the bit), so the bf16 y is
never written and read back and the quantiser is not a launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.fp8_quant import INTERPRETED, fp8_rows, fp8_scale, fp8_values
from worker.model.quant import FP8_MAX, FP8_MIN_SCALE, QuantizedRows

MAX_ROW = 65536  # one row must fit one program's registers


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    y_ptr,
    res_out_ptr,
    n_cols,
    eps,
    stride_x,
    stride_res,
    stride_y,
    stride_res_out,
    scale_ptr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,  # y_ptr is FP8 and scale_ptr its rows' scales
    ROUND_FIRST: tl.constexpr,  # the CPU interpreter's cast rounds wrongly (kernels.fp8_quant)
    FP8_LIMIT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
        # Round the sum to the model dtype: residual_out and the norm see the same value.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)  # masked lanes are 0: the sum is exact
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        # The row the unfused path quantises is y in the model dtype: round there first.
        y = (xf * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(y), 0), FP8_LIMIT, MIN_SCALE)
        q = fp8_values(y, scale, FP8_LIMIT, ROUND_FIRST)
        tl.store(y_ptr + row * stride_y + offs, q.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + row, scale)
    else:
        tl.store(y_ptr + row * stride_y + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> None:
    assert x.dim() == 2, f"x {tuple(x.shape)}: want [T, N]"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)}: want [{x.shape[1]}]"
    assert x.shape[1] <= MAX_ROW, f"row of {x.shape[1]} > {MAX_ROW}"
    for t in others:
        assert t.shape == x.shape and t.dtype == x.dtype, f"{tuple(t.shape)} {t.dtype} vs x {tuple(x.shape)} {x.dtype}"
    assert all(t.device == x.device for t in (weight, *others)), "all inputs on one device"
    assert all(t.stride(-1) == 1 for t in (x, weight, *others)), "rows must be contiguous"


def _launch(x, residual, weight, y, residual_out, eps: float, scale: torch.Tensor | None = None) -> None:
    """y in x's dtype, or FP8 with ``scale`` [T] fp32 given (the norm quantised per row)."""
    num_rows, n_cols = x.shape  # [T, N]
    if num_rows == 0:
        return
    has_res = residual is not None
    res, res_out = (residual, residual_out) if has_res else (x, y)  # unused when not has_res
    block = triton.next_power_of_2(n_cols)
    _rmsnorm_kernel[(num_rows,)](
        x,
        res,
        weight,
        y,
        res_out,
        n_cols,
        eps,
        x.stride(0),
        res.stride(0),
        y.stride(0),
        res_out.stride(0),
        y if scale is None else scale,  # never read when not quantising
        # ~1024 elements per warp: 4 warps at hidden 4096 beat 8-16 on an H200.
        HAS_RESIDUAL=has_res,
        BLOCK=block,
        QUANT=scale is not None,
        ROUND_FIRST=INTERPRETED,
        FP8_LIMIT=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        num_warps=min(8, max(1, block // 1024)),
    )


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """y[T, N] = rmsnorm(x) * weight. out may be x itself (each row is read before it is written)."""
    y = torch.empty_like(x) if out is None else out
    _check(x, weight, y)
    _launch(x, None, weight, y, None, eps)
    return y


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, residual_out) with residual_out = x + residual, y = rmsnorm(residual_out) * weight.

    out=x and residual_out=residual update in place: a program reads its row before writing it.
    """
    y = torch.empty_like(x) if out is None else out
    res_out = torch.empty_like(x) if residual_out is None else residual_out
    _check(x, weight, residual, y, res_out)
    _launch(x, residual, weight, y, res_out, eps)
    return y, res_out


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, out: QuantizedRows | None = None) -> QuantizedRows:
    """``rmsnorm(x)`` quantised per row for an FP8 linear: (q [T, N] FP8, scale [T] fp32)."""
    out = fp8_rows(x) if out is None else out
    _check(x, weight)
    _launch(x, None, weight, out.q, None, eps, out.scale)
    return out


def fused_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: QuantizedRows | None = None
) -> tuple[QuantizedRows, torch.Tensor]:
    """``fused_add_rmsnorm``, its y quantised per row; residual_out a new tensor."""
    out = fp8_rows(x) if out is None else out
    res_out = torch.empty_like(x)
    _check(x, weight, residual, res_out)
    _launch(x, residual, weight, out.q, res_out, eps, out.scale)
    return out, res_out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(s, weight, eps), s
