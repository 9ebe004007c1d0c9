"""The preallocated KV pool every layer's attention reads and writes.

One buffer ``[num_layers, num_slots + 1, 2 * Hkv, D]``, LightLLM's layout:
a slot holds one token's K heads (``[..., :Hkv, :]``) then its V heads
(``[..., Hkv:, :]``), so storing a token is a single row write. Slot
``num_slots`` is the hold slot: ``TokenPool`` never hands it out, and padded
(CUDA-graph) tokens write there, so its contents are garbage by design.
"""

from __future__ import annotations

import torch


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

    @property
    def hold_slot(self) -> int:
        return self.num_slots

    def k(self, layer: int) -> torch.Tensor:
        """[num_slots + 1, Hkv, D] view of ``layer``'s keys."""
        return self.buffer[layer, :, : self.num_kv_heads]

    def v(self, layer: int) -> torch.Tensor:
        """[num_slots + 1, Hkv, D] view of ``layer``'s values."""
        return self.buffer[layer, :, self.num_kv_heads :]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Pool bytes one token costs over all layers (K and V): sizes the pool from free memory."""
        return 2 * num_kv_heads * head_dim * num_layers * dtype.itemsize
