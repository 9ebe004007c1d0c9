"""The attention-backend interface and its pure-PyTorch reference.

A backend is chosen once at start-up (the reference on CPU, Triton kernels on
CUDA) and handed to the model; the model never branches on the device.
"""

from __future__ import annotations

import math
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


class TorchAttention:
    """The pure-PyTorch reference backend: the CPU path and the kernels' test oracle.

    Scores and softmax are fp32 whatever the cache dtype. Masked-out keys
    (past seq_lens, or in the causal future) get probability exactly 0 and
    their values are zeroed before the weighted sum, so garbage in unused
    slots (the hold slot, stale slots) can never leak in, not even as NaN.
    """

    def __init__(self, cache: KVCache):
        self.cache = cache

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        buf = self.cache.buffer[layer]  # [S+1, 2Hkv, D]
        buf[batch.out_slots.long()] = torch.cat((k, v), dim=1).to(buf.dtype)
        if batch.is_decode:
            return self._decode(buf, q, batch)
        return self._prefill(buf, q, batch)

    def _split_kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hkv = self.cache.num_kv_heads
        return kv[..., :hkv, :].float(), kv[..., hkv:, :].float()

    def _decode(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """One query per request: all requests at once, keys padded to max_seq_len."""
        B, Hq, D = q.shape  # T == B
        hkv = self.cache.num_kv_heads
        L = batch.max_seq_len
        slots = batch.req_table[batch.req_rows.long(), :L].long()  # [B, L]
        keys, values = self._split_kv(buf[slots])  # [B, L, Hkv, D] each
        valid = torch.arange(L, device=q.device)[None, :] < batch.seq_lens[:, None]  # [B, L]
        values = values.masked_fill(~valid[:, :, None, None], 0.0)
        qg = q.float().view(B, hkv, Hq // hkv, D)  # [B, Hkv, G, D]
        scores = torch.einsum("bhgd,blhd->bhgl", qg, keys) / math.sqrt(D)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgl,blhd->bhgd", probs, values)  # [B, Hkv, G, D]
        return out.reshape(B, Hq, D).to(q.dtype)

    def _prefill(self, buf: torch.Tensor, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """A loop over requests: each attends its q_lens[b] queries causally."""
        T, Hq, D = q.shape
        hkv = self.cache.num_kv_heads
        out = torch.empty_like(q)
        rows = batch.req_rows.tolist()
        starts, lens = batch.q_starts.tolist(), batch.q_lens.tolist()
        cached, seqs = batch.cached_lens.tolist(), batch.seq_lens.tolist()
        for row, s, n, c, L in zip(rows, starts, lens, cached, seqs):
            slots = batch.req_table[row, :L].long()  # [L]
            keys, values = self._split_kv(buf[slots])  # [L, Hkv, D] each
            qg = q[s:s + n].float().view(n, hkv, Hq // hkv, D)  # [n, Hkv, G, D]
            scores = torch.einsum("nhgd,lhd->hgnl", qg, keys) / math.sqrt(D)
            # query i sits at position c + i and sees keys at positions <= c + i
            future = torch.arange(L, device=q.device)[None, :] > (c + torch.arange(n, device=q.device))[:, None]
            scores = scores.masked_fill(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[s:s + n] = torch.einsum("hgnl,lhd->nhgd", probs, values).reshape(n, Hq, D).to(q.dtype)
        return out


def make_backend(cache: KVCache, device: torch.device | str) -> AttentionBackend:
    """The attention backend for ``device``, chosen once: Triton kernels on CUDA,
    the PyTorch reference elsewhere."""
    if torch.device(device).type == "cuda":
        from worker.triton_attention import TritonAttention  # triton needs a GPU outside tests

        return TritonAttention(cache)
    return TorchAttention(cache)
