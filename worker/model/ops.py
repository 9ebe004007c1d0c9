"""The pointwise kernels a layer runs, one object per backend, chosen in one place.

``ops_for(device)`` is the only place the backend is picked from the device:
Triton kernels on CUDA, the PyTorch reference elsewhere (``make_backend`` picks
attention by the same rule, through ``is_triton``). A layer keeps the object it
gets and calls its methods; no layer branches on the device or rebinds one.
The Triton kernels import lazily: a CPU worker never loads Triton.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def is_triton(device: torch.device | str) -> bool:
    """The one backend rule: Triton on CUDA, PyTorch elsewhere."""
    return torch.device(device).type == "cuda"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its token's angles; cos, sin [T, 1, D]."""
    return x * cos + rotate_half(x) * sin


class TorchOps:
    """The reference: plain PyTorch, as transformers computes it."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight, the variance in fp32 and the product in x's dtype, as HF Llama."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); the sum rounded to the model dtype first."""
        s = residual + x
        return self.rms_norm(s, weight, eps), s

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x = [gate | up] along the last dim."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] rotated by cos, sin [T, 1, D]."""
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class TritonOps:
    """The same four, as Triton kernels (the add fused into the norm)."""

    def __init__(self):
        from worker.model.kernels import rmsnorm, rotary, silu_and_mul

        self._rmsnorm, self._rotary, self._silu_and_mul = rmsnorm, rotary, silu_and_mul

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rmsnorm.rmsnorm(x.contiguous(), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rmsnorm.fused_add_rmsnorm(x.contiguous(), residual.contiguous(), weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul.silu_and_mul(x)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """In place on q, k (views of the fused qkv output). cos/sin [T, 1, D] repeat
        their first half (the table is cat(freqs, freqs)), so the kernel takes [T, D/2]:
        strided views, no copy (the kernel reads rows by stride; the two copies were two of a
        decode step's kernels in every layer)."""
        half = cos.shape[-1] // 2
        self._rotary.rotary_embedding(q, k, cos[:, 0, :half], sin[:, 0, :half])
        return q, k


Ops = TorchOps | TritonOps


def ops_for(device: torch.device | str) -> Ops:
    """The one ops object of ``device``'s backend, shared by every layer (built on first use)."""
    return _ops(is_triton(device))


@functools.cache
def _ops(triton: bool) -> Ops:
    return TritonOps() if triton else TorchOps()
