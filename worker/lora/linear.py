"""``LoraLinear``: a linear layer of the model with every adapter's delta added to its output."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from worker.lora.delta import add_lora
from worker.model.forward_batch import ForwardBatch
from worker.model.kernels.lora_shards import Shards

if TYPE_CHECKING:
    from worker.model.kernels.bgmv_grouped import TokenGroups


class BatchSource(Protocol):
    """Where a forward's batch is bound (``AdapterSet.bind``) for its layers to read."""

    bound: ForwardBatch | None
    groups: TokenGroups | None  # the bound forward's tokens grouped by slot, where that kernel serves


class LoraLinear(nn.Module):
    """y = base(x) + the delta of each token's adapter (``worker.lora.delta``).

    ``base`` is the layer as it was (``Linear``, ``Fp8Linear``; packed for small batches or not),
    unchanged. A and B are this layer's stacks of every adapter, [S, R, in] and [S, out, R] (a fused
    layer's shards side by side, see ``AdapterSet``); the batch's slots come from the set's bound
    batch, None outside a forward or for a batch without adapters: then this is ``base``.
    """

    takes_quantized_rows = False  # the adapters' shrink reads x in the model dtype

    def __init__(
        self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, adapters: BatchSource, sizes: list[int] | None = None
    ):
        super().__init__()
        self.base = base
        self.sizes = sizes or [b.shape[1]]  # rows of each fused shard (qkv: 3), in order
        self.rank = a.shape[1] // len(self.sizes)  # columns per shard: the widest adapter's rank
        ends = [sum(self.sizes[: k + 1]) for k in range(len(self.sizes))]
        self.shards = Shards(tuple(ends), self.rank)  # B is block diagonal: the kernels skip its zero blocks
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)
        self.adapters = adapters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [T, out]
        batch = self.adapters.bound
        if batch is None or batch.lora_slots is None:
            return y
        return add_lora(y, x, self.lora_a, self.lora_b, batch, self.adapters.groups, self.shards)
