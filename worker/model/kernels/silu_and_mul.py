"""out = silu(gate) * up for the MLP, where x = [gate | up] along the last dim.

x is the fused gate_up projection's output [T, 2N] (gate first, as LightLLM
and vLLM lay it out). Math in fp32, one rounding at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


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


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    n_cols = x.shape[1] // 2
    xf = x.float()
    return (torch.nn.functional.silu(xf[:, :n_cols]) * xf[:, n_cols:]).to(x.dtype)
