"""RMSNorm, plain and fused with the residual add that precedes it.

Fused: s = x + residual (rounded to the model dtype, as the unfused model
keeps it); residual_out = s; y = s * rsqrt(mean(s^2) + eps) * w. The
variance and the scaling run in fp32 and round once at the end (HF Llama
rounds before multiplying by w; the difference is within one ulp of the
dtype). One program per row, whole row in registers: rows are the hidden
size (4096 for Llama-3-8B), far below what fits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
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
    tl.store(y_ptr + row * stride_y + offs, (xf * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> None:
    assert x.dim() == 2, f"x {tuple(x.shape)}: want [T, N]"
    assert weight.shape == (x.shape[1],), f"weight {tuple(weight.shape)}: want [{x.shape[1]}]"
    assert x.shape[1] <= MAX_ROW, f"row of {x.shape[1]} > {MAX_ROW}"
    for t in others:
        assert t.shape == x.shape and t.dtype == x.dtype, f"{tuple(t.shape)} {t.dtype} vs x {tuple(x.shape)} {x.dtype}"
    assert all(t.device == x.device for t in (weight, *others)), "all inputs on one device"
    assert all(t.stride(-1) == 1 for t in (x, weight, *others)), "rows must be contiguous"


def _launch(x, residual, weight, y, residual_out, eps: float) -> None:
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
        # ~1024 elements per warp: 4 warps at hidden 4096 beat 8-16 on an H200.
        HAS_RESIDUAL=has_res,
        BLOCK=block,
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


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(s, weight, eps), s
