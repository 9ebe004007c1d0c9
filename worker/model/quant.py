"""FP8 numbers: e4m3's constants and the per-row quantiser every FP8 path and kernel reference uses.

Torch only (no Triton, no layer): the CPU path, the kernels' references and the
loaders import it alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# FP8 (e4m3, the "fn" variant: no infinities, largest finite 448): weights, activations and KV.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The smallest scale a row gets: an all-zero row (a CUDA-graph padding token, an unwritten slot)
# then quantises to zeros, never 0 / 0. Far below any real row's amax / 448.
FP8_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] FP8, scale [...] fp32) with x ~ q * scale, one scale per row
    (per output channel of a weight, per token of an activation, per token and head of K/V):
    scale = max(amax(|row|) / 448, FP8_MIN_SCALE), q = clamp(row / scale) rounded to nearest even.
    The Triton quantisers (``kernels.fp8_quant``, ``kernels.copy_kv``) do the same fp32 operations."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # A tensor divisor, not the number: CUDA divides by a Python scalar as a product with its
    # reciprocal (1 ulp off in places, seen on an H200), the kernels' div_rn and the CPU divide.
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=FP8_MIN_SCALE)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 q * scale (scale [...] broadcast over the rows' last dim)."""
    return q.float() * scale.unsqueeze(-1)


@dataclass(frozen=True)
class QuantizedRows:
    """A linear layer's input already quantised per token (``quantize_rows``'s q and scale), by the
    kernel that made it (the norm or SiLU-and-mul before an FP8 linear: ``worker.model.ops``), so
    the linear does not quantise it again. ``dtype`` is the model dtype the linear returns."""

    q: torch.Tensor  # [T, K] FP8
    scale: torch.Tensor  # [T] fp32
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape
