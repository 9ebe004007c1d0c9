"""out = silu(gate) * up for the MLP, where x = [gate | up] along the last dim.

x is the fused gate_up projection's output [T, 2N] (gate first, as LightLLM
and vLLM lay it out). Math in fp32, one rounding at the end.

``silu_and_mul_fp8``: the product quantised per row for the FP8 down projection
(``worker.model.quant.QuantizedRows``). A row's scale needs the whole row's
amax, so one program takes a row: its products (rounded to the model dtype, as
the unfused path stores them), their amax, then the products quantised as
``kernels.fp8_quant`` does (to the bit). Up to ``ONE_PASS_MAX`` columns (Llama-3-8B's
14,336) the row stays in registers between the two (one read of gate and up, all
of it in flight at once); a longer row is taken in two passes over pieces, the
second re-reading gate and up, mostly from L2. On an H100 the two-pass kernel on
Llama-3-8B's rows ran at ~1.45 TB/s, seven dependent pieces a pass (bench/RESULTS.md).
The bf16 product is never written and read back, and the quantiser is not a
launch of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.fp8_quant import INTERPRETED, fp8_rows, fp8_scale, fp8_values
from worker.model.quant import FP8, FP8_MAX, FP8_MIN_SCALE, QuantizedRows

BLOCK = 1024
FP8_BLOCK = 2048  # a row's piece per loop step in the quantising kernel's two passes
ONE_PASS_MAX = 16384  # rows up to this many columns are quantised from registers, in one read


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    # Grid (T, cdiv(N, BLOCK)): a column tile of one row, so long rows spread over programs.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_piece(x_row, offs, n_cols):
    """silu(gate) * up of one piece of a row, rounded to the model dtype, in fp32."""
    mask = offs < n_cols
    gate = tl.load(x_row + offs, mask=mask, other=0.0)
    up = tl.load(x_row + n_cols + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    return (g * tl.sigmoid(g) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_cols,
    stride_x,
    stride_q,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK covers the row: its products stay in registers
    ROUND_FIRST: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if ONE_PASS:
        offs = tl.arange(0, BLOCK)
        y = _silu_mul_piece(x_row, offs, n_cols)  # masked lanes are 0: the amax is the row's
        scale = fp8_scale(tl.max(tl.abs(y), 0), FP8_LIMIT, MIN_SCALE)
        q = fp8_values(y, scale, FP8_LIMIT, ROUND_FIRST)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < n_cols)
        tl.store(scale_ptr + row, scale)
        return
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        amax = tl.maximum(amax, tl.abs(_silu_mul_piece(x_row, c0 + tl.arange(0, BLOCK), n_cols)))
    scale = fp8_scale(tl.max(amax, 0), FP8_LIMIT, MIN_SCALE)
    for c0 in range(0, n_cols, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        q = fp8_values(_silu_mul_piece(x_row, offs, n_cols), scale, FP8_LIMIT, ROUND_FIRST)
        tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=offs < n_cols)
    tl.store(scale_ptr + row, scale)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2N] -> out [T, N] = silu(x[:, :N]) * x[:, N:]."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x {tuple(x.shape)}: want [T, 2N]"
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_rows, n_cols), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n_cols) and out.dtype == x.dtype and out.device == x.device, (
        f"out {tuple(out.shape)} {out.dtype}: want [{num_rows}, {n_cols}] {x.dtype}"
    )
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    if num_rows == 0 or n_cols == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(n_cols, block))](
        x,
        out,
        n_cols,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=4,
    )
    return out


def silu_and_mul_fp8(
    x: torch.Tensor, out: QuantizedRows | None = None, one_pass_max: int = ONE_PASS_MAX
) -> QuantizedRows:
    """x [T, 2N] -> silu(x[:, :N]) * x[:, N:] quantised per row: (q [T, N] FP8, scale [T] fp32).
    Rows of up to ``one_pass_max`` columns in one read (the module's docstring)."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1, f"x {tuple(x.shape)}: want [T, 2N], contiguous"
    num_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = fp8_rows(x, n_cols) if out is None else out
    q, scale = out.q, out.scale
    assert q.shape == (num_rows, n_cols) and q.dtype == FP8 and q.stride(1) == 1, f"q {tuple(q.shape)} {q.dtype}"
    if num_rows and n_cols:
        one_pass = n_cols <= one_pass_max
        block = triton.next_power_of_2(n_cols) if one_pass else FP8_BLOCK
        _silu_and_mul_fp8_kernel[(num_rows,)](
            x,
            q,
            scale,
            n_cols,
            x.stride(0),
            q.stride(0),
            BLOCK=block,
            ONE_PASS=one_pass,
            ROUND_FIRST=INTERPRETED,
            FP8_LIMIT=FP8_MAX,
            MIN_SCALE=FP8_MIN_SCALE,
            # ~1,024 elements a warp (16 warps at 14,336 columns: 32 a thread)
            num_warps=max(4, min(16, block // 1024)),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    n_cols = x.shape[1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[:, :n_cols]) * xf[:, n_cols:]).to(x.dtype)
