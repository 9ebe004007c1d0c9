"""The preallocated KV pool every layer's attention reads and writes.

One buffer ``[num_layers, num_slots + 1, 2 * Hkv, D]``, LightLLM's layout:
a slot holds one token's K heads (``[..., :Hkv, :]``) then its V heads
(``[..., Hkv:, :]``), so storing a token is a single row write. Slot
``num_slots`` is the hold slot: ``TokenPool`` never hands it out, and padded
(CUDA-graph) tokens write there, so its contents are garbage by design.

FP8 (``--kv_cache_dtype fp8_e4m3``): the buffer holds e4m3 values and ``scales``
``[num_layers, num_slots + 1, 2 * Hkv]`` fp32 one scale per token and head (K's
then V's, as the heads), so a head's vector of D values is ``buffer * scale``.
Scales per token and head, not one per head fixed in advance: they need no
calibration, a token whose keys run large (the outliers of a few channels and
positions) costs only its own precision, and they are written with the token by
the same kernel (``kernels.copy_kv``). They cost 4 bytes per D = 128 values: a
token takes 0.516 of its bf16 bytes, so the pool holds 1.94x the tokens.

In memory the scales are head-major (``[num_layers, 2 * Hkv, num_slots + 1]``;
``scales`` is its transposed view, so it indexes as above): a decode kernel's
program reads one head's scales for a block of slots, and where those slots are
consecutive (a prompt, written by one prefill) the block's scales are one
contiguous read, not a 32-byte sector fetched per token for a 4-byte value.
"""

from __future__ import annotations

import torch

from worker.model.quant import FP8, quantize_rows

KV_DTYPES = ("auto", "fp8_e4m3")


def kv_storage_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """What the pool stores for ``--kv_cache_dtype``: 'auto', the model's dtype; 'fp8_e4m3', FP8."""
    if kv_cache_dtype not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: one of {', '.join(KV_DTYPES)}")
    return FP8 if kv_cache_dtype == "fp8_e4m3" else model_dtype


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # Zeros, not empty: a slot never written must not hold NaN/inf that a
        # masked-out read could turn into NaN (0 * inf) in some kernel.
        self.buffer = torch.zeros(num_layers, num_slots + 1, 2 * num_kv_heads, head_dim, dtype=dtype, device=device)
        self.scales: torch.Tensor | None = None  # [layers, slots + 1, 2 * Hkv] fp32 when FP8
        if dtype == FP8:  # head-major in memory (above)
            self.scales = torch.zeros(num_layers, 2 * num_kv_heads, num_slots + 1, device=device).transpose(1, 2)

    @property
    def hold_slot(self) -> int:
        return self.num_slots

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.buffer.numel() * self.buffer.element_size() + scales

    def k(self, layer: int) -> torch.Tensor:
        """[num_slots + 1, Hkv, D] view of ``layer``'s keys."""
        return self.buffer[layer, :, : self.num_kv_heads]

    def v(self, layer: int) -> torch.Tensor:
        """[num_slots + 1, Hkv, D] view of ``layer``'s values."""
        return self.buffer[layer, :, self.num_kv_heads :]

    def store(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Slots [N] of ``layer`` = kv [N, 2 * Hkv, D] (K heads, then V heads); quantised per token and
        head when FP8. The PyTorch backend's write (``kernels.copy_kv`` is the Triton one)."""
        if self.scales is None:
            self.buffer[layer][slots] = kv.to(self.buffer.dtype)
            return
        q, scale = quantize_rows(kv)
        self.buffer[layer][slots] = q
        self.scales[layer][slots] = scale

    @property
    def attention_dtype(self) -> torch.dtype:
        """What the PyTorch attention computes in over this pool (``read``'s dtype): a 16-bit float pool's
        own dtype (products exact and sums fp32 inside torch's fused kernel, the probabilities rounded to
        it before P V, as the GPU kernels have it; no fp32 copy of every key read), fp32 otherwise (an
        fp32 pool; FP8, dequantised)."""
        return self.buffer.dtype if self.buffer.dtype in (torch.bfloat16, torch.float16) else torch.float32

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[N, 2 * Hkv, D] of ``layer``'s slots [N] (flat) in ``attention_dtype``, dequantised when FP8."""
        rows = self.buffer[layer].flatten(1).index_select(0, slots).view(-1, 2 * self.num_kv_heads, self.head_dim)
        if self.scales is None:
            return rows.to(self.attention_dtype)
        return rows.float() * self.scales[layer].index_select(0, slots)[:, :, None]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Pool bytes one token costs over all layers (K and V, and their scales when ``dtype`` is FP8):
        sizes the pool from free memory."""
        scales = 4 if dtype == FP8 else 0  # one fp32 per head
        return 2 * num_kv_heads * (head_dim * dtype.itemsize + scales) * num_layers
