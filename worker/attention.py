"""The attention-backend interface and its pure-PyTorch reference.

A backend is chosen once at start-up (the reference on CPU, Triton kernels on
CUDA) and handed to the model; the model never branches on the device.
"""

from __future__ import annotations

from typing import Protocol

import torch

from worker.forward_batch import ForwardBatch
from worker.kv_cache import KVCache


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """Store this step's K/V, then attend.

        q: [T, Hq, D]; k, v: [T, Hkv, D] (rotary already applied). Writes k, v
        into ``layer``'s pool at ``batch.out_slots``, then for each request b
        attends its new queries over its first ``seq_lens[b]`` pool tokens read
        through ``req_table``, causally (query i of b sees positions
        <= cached_lens[b] + i). Returns [T, Hq, D].
        """
        ...
