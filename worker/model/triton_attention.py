"""The CUDA attention backend: LightLLM-style Triton kernels over the token pool.

Per layer: copy_kv scatters this step's K/V into their pool slots, then
prefill (context_attention) or decode (decode_attention, split-K) attention
reads everything, cached prefix included, from the pool through req_table.

The KV cache is duck-typed: any object whose ``.buffer`` is a tensor
``[num_layers, num_slots + 1, 2 * Hkv, D]`` (K heads first, then V heads) and
whose ``.scales`` is None, or for an FP8 buffer ``[num_layers, num_slots + 1,
2 * Hkv]`` fp32 (``worker.model.kv_cache``): copy_kv quantises into it and the
attention kernels dequantise as they read.

CUDA graphs (decode): forward does no host sync and reads per-request data
(seq_lens, req_rows, req_table, out_slots) on the device only. The host ints
it depends on, frozen into a captured graph, are the tensor shapes (B, Hq,
Hkv, D) and ``batch.max_seq_len``, which fixes the split count and split
length of decode attention: capture with the largest context a replay may
see. Prefill also uses ``batch.max_q_len`` (grid size) and is not captured.
"""

from __future__ import annotations

import torch

from worker.model.forward_batch import ForwardBatch
from worker.model.kernels.context_attention import context_attention
from worker.model.kernels.copy_kv import copy_kv
from worker.model.kernels.decode_attention import decode_attention


class TritonAttention:
    def __init__(self, kv_cache, sm_scale: float | None = None):
        buffer = kv_cache.buffer
        assert buffer.dim() == 4 and buffer.shape[2] % 2 == 0, (
            f"kv buffer {tuple(buffer.shape)}: want [layers, num_slots + 1, 2 * Hkv, D]"
        )
        self.kv_cache = kv_cache
        self.sm_scale = sm_scale  # None: 1 / sqrt(D)

    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        alibi_slopes: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; see AttentionBackend.forward."""
        pool = self.kv_cache.buffer[layer]  # [num_slots + 1, 2 * Hkv, D]
        num_kv_heads = pool.shape[1] // 2
        assert k.shape[1] == num_kv_heads, f"k has {k.shape[1]} heads, the pool {num_kv_heads}"
        scales = None if getattr(self.kv_cache, "scales", None) is None else self.kv_cache.scales[layer]
        copy_kv(k, v, batch.out_slots, pool, scales)
        k_cache, v_cache = pool[:, :num_kv_heads], pool[:, num_kv_heads:]  # [S, Hkv, D] views
        kv_scales = {}
        if scales is not None:  # [S, Hkv] views of the FP8 pool's scales
            kv_scales = dict(k_scale=scales[:, :num_kv_heads], v_scale=scales[:, num_kv_heads:])
        o = torch.empty_like(q)
        if batch.is_decode:
            # q_lens == 1, so token b is request b's query: q is [B, Hq, D].
            decode_attention(
                q,
                k_cache,
                v_cache,
                o,
                batch.req_rows,
                batch.seq_lens,
                batch.req_table,
                batch.max_seq_len,
                sm_scale=self.sm_scale,
                alibi_slopes=alibi_slopes,
                window=window,
                **kv_scales,
            )
        else:
            context_attention(
                q,
                k_cache,
                v_cache,
                o,
                batch.q_starts,
                batch.q_lens,
                batch.cached_lens,
                batch.seq_lens,
                batch.req_rows,
                batch.req_table,
                batch.max_q_len,
                sm_scale=self.sm_scale,
                alibi_slopes=alibi_slopes,
                window=window,
                **kv_scales,
            )
        return o
