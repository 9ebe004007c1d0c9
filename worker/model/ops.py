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

from worker.model.quant import QuantizedRows, quantize_rows


def is_triton(device: torch.device | str) -> bool:
    """The one backend rule: Triton on CUDA, PyTorch elsewhere."""
    return torch.device(device).type == "cuda"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by its token's angles; cos, sin [T, 1, D]: transformers' rotate-half,
    ``x * cos + cat(-x2, x1) * sin``, in three passes and no rotated copy: x * cos, then each half's
    product with the other added in place (``addcmul_``, one rounding fewer: within an ulp). On a
    CPU the five ops it replaces were 10 of a decode layer's ~50 small ops, and 4x slower on a
    prefill's 4,096 tokens (bench/RESULTS.md)."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, Hq + Hkv, D], one view of q's heads then k's, where k's follow q's in memory row by row."""
    hq, d = q.shape[1], q.shape[2]
    if q.stride() != k.stride() or q.stride(1) != d or q.stride(2) != 1 or k.shape[2] != d:
        return None
    if k.data_ptr() != q.data_ptr() + hq * d * q.element_size() or k.dtype != q.dtype:
        return None
    return q.as_strided((q.shape[0], hq + k.shape[1], d), q.stride())


class TorchOps:
    """The reference: plain PyTorch, as transformers computes it."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight, the variance in fp32. Where x and the weight share a dtype, torch's fused
        ``rms_norm``, one op for seven: in fp32 HF Llama's values exactly (its casts do nothing); in bf16
        or fp16 fp32 inside and one rounding at the end, where HF rounds x / rms(x) to x's dtype before
        the product (1 ulp apart on about a quarter of the values; the CPU's bf16 prefill spent ~0.4 s
        of a 3 s burst on the seven). Mixed dtypes: HF's steps, written out."""
        if x.dtype == weight.dtype:
            return torch.rms_norm(x, weight.shape, weight, eps)
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
        return F.silu(gate).mul_(up)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] rotated by cos, sin [T, 1, D]; in one pass where k's heads follow
        q's in each row (views of one fused qkv output): half the small ops of a CPU decode layer's rotary."""
        joint = _adjacent_heads(q, k)
        if joint is None:
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = apply_rotary(joint, cos, sin)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]

    def quantizes_rows(self, rows: int) -> bool:
        """Whether ``fp8_linear`` quantises an input of ``rows`` tokens per token, so that the kernel
        before it may do it instead (``*_fp8`` below, ``QuantizedRows``): here always."""
        return True

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
        return QuantizedRows(*quantize_rows(self.rms_norm(x, weight, eps)), x.dtype)

    def add_rms_norm_fp8(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedRows, torch.Tensor]:
        y, s = self.add_rms_norm(x, residual, weight, eps)
        return QuantizedRows(*quantize_rows(y), x.dtype), s

    def silu_and_mul_fp8(self, x: torch.Tensor) -> QuantizedRows:
        return QuantizedRows(*quantize_rows(self.silu_and_mul(x)), x.dtype)

    def fp8_linear(
        self,
        x: torch.Tensor | QuantizedRows,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        quantize_inputs: bool = True,
    ) -> torch.Tensor:
        """x [T, K] @ (weight [N, K] FP8 * weight_scale [N])^T (+ bias) in x's dtype: x quantised per
        token (``quantize_rows``, unless it comes quantised; not with ``quantize_inputs`` False: W8A16),
        the product in fp32 (exact products, fp32 sums), then the scales: what ``torch._scaled_mm``
        computes, as a reference and the CPU path."""
        if isinstance(x, QuantizedRows) or quantize_inputs:
            xq, xs, dtype = (x.q, x.scale, x.dtype) if isinstance(x, QuantizedRows) else (*quantize_rows(x), x.dtype)
            y = (xq.float() @ weight.float().T) * xs[:, None] * weight_scale[None, :]
        else:
            y, dtype = (x.float() @ weight.float().T) * weight_scale[None, :], x.dtype
        return (y if bias is None else y + bias.float()).to(dtype)


class TritonOps:
    """The same, as Triton kernels (the add fused into the norm) and cuBLASLt's FP8 matmul."""

    def __init__(self):
        from worker.model.kernels import fp8_quant, gemv, rmsnorm, rotary, silu_and_mul, w8a16_gemm

        self._rmsnorm, self._rotary, self._silu_and_mul = rmsnorm, rotary, silu_and_mul
        self._fp8_quant, self._gemv, self._w8a16 = fp8_quant, gemv, w8a16_gemm

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

    def quantizes_rows(self, rows: int) -> bool:
        """More rows than the GEMV takes: those go through ``_scaled_mm``, quantised per token."""
        return rows > self._gemv.MAX_ROWS

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> QuantizedRows:
        return self._rmsnorm.rmsnorm_fp8(x.contiguous(), weight, eps)

    def add_rms_norm_fp8(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[QuantizedRows, torch.Tensor]:
        return self._rmsnorm.fused_add_rmsnorm_fp8(x.contiguous(), residual.contiguous(), weight, eps)

    def silu_and_mul_fp8(self, x: torch.Tensor) -> QuantizedRows:
        return self._silu_and_mul.silu_and_mul_fp8(x)

    def fp8_linear(
        self,
        x: torch.Tensor | QuantizedRows,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        quantize_inputs: bool = True,
    ) -> torch.Tensor:
        """Up to ``gemv.MAX_ROWS`` rows (a small decode step, a weight read): the split-K GEMV reads the
        FP8 weight and scales it in-kernel, x stays in its dtype (W8A16: half the bytes, no activation
        quantisation). More rows: x quantised per token, then ``torch._scaled_mm`` (cuBLASLt, FP8 tensor
        cores) with row-wise scales; it gives bf16 only, and takes no bias with row-wise scales. With
        ``quantize_inputs`` False (W8A16 throughout), more rows take ``kernels.w8a16_gemm``: FP8 weight
        tiles converted in registers, never a converted copy of the weight."""
        if isinstance(x, QuantizedRows):  # quantised by the kernel before (``quantizes_rows``)
            xq, xs, dtype = x.q, x.scale, x.dtype
        elif x.shape[0] <= self._gemv.MAX_ROWS:
            config = self._gemv.fp8_config(weight.shape[0], weight.shape[1], _num_sms(x.device))
            return self._gemv.gemv(x, weight, bias, config, weight_scale=weight_scale)
        elif not quantize_inputs:
            return self._w8a16.w8a16_matmul(x, weight, weight_scale, bias)
        else:
            (xq, xs), dtype = self._fp8_quant.quantize_rows(x), x.dtype
        y = torch._scaled_mm(xq, weight.T, scale_a=xs[:, None], scale_b=weight_scale[None, :], out_dtype=torch.bfloat16)
        y = y if bias is None else y + bias
        return y if dtype == torch.bfloat16 else y.to(dtype)


Ops = TorchOps | TritonOps


def ops_for(device: torch.device | str) -> Ops:
    """The one ops object of ``device``'s backend, shared by every layer (built on first use)."""
    return _ops(is_triton(device))


@functools.cache
def _ops(triton: bool) -> Ops:
    return TritonOps() if triton else TorchOps()


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
