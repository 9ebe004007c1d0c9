"""``SequencePool``: whole token sequences through the model and its real pool, without the engine.

For the tools that score or calibrate a model on a fixed text (``lightq quantize``'s GPTQ
calibration, ``bench.engine.fp8_accuracy``): each sequence gets a table row and the slots
``row * width + position``, prefills are packed, and decode steps feed one token to every row,
through the same attention backend and kernels the worker runs.
"""

from __future__ import annotations

import torch

from worker.model.attention import make_backend
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.runner.req_table import ReqTable


class SequencePool:
    """One model's pool in one dtype, with a table row per sequence: slots ``row * width + position``."""

    def __init__(self, model, dtype: torch.dtype, rows: int, width: int, device: torch.device):
        self.cache = KVCache(model.num_layers, rows * width, model.num_kv_heads, model.head_dim, dtype, device)
        self.backend = make_backend(self.cache, device)
        self.table = ReqTable(rows, width, self.cache.hold_slot, device)
        self.width, self.device = width, device
        slots = torch.arange(rows * width, dtype=torch.int32, device=device).view(rows, width)
        self.table.table[:rows] = slots

    def prefill(self, model, seqs: torch.Tensor, all_logits: bool) -> torch.Tensor:
        """seqs [B, L] from position 0 -> logits [B * L, V] (every position) or [B, V] (each last)."""
        B, L = seqs.shape
        dev, i32 = self.device, torch.int32
        rows = torch.arange(B, device=dev, dtype=i32)
        positions = torch.arange(L, device=dev).repeat(B)
        batch = ForwardBatch(
            input_ids=seqs.reshape(-1),
            positions=positions,
            out_slots=(rows.long()[:, None] * self.width + torch.arange(L, device=dev)).reshape(-1),
            req_rows=rows,
            cached_lens=torch.zeros(B, device=dev, dtype=i32),
            seq_lens=torch.full((B,), L, device=dev, dtype=i32),
            q_starts=rows * L,
            q_lens=torch.full((B,), L, device=dev, dtype=i32),
            req_table=self.table.table,
            max_seq_len=L,
            max_q_len=L,
            is_decode=False,
            logit_index=torch.arange(B * L, device=dev) if all_logits else None,
        )
        model.set_backend(self.backend)
        return model(batch)

    def decode(self, model, ids: torch.Tensor, position: int) -> torch.Tensor:
        """ids [B] at ``position`` of every row -> logits [B, V]."""
        B, dev, i32 = ids.shape[0], self.device, torch.int32
        rows = torch.arange(B, device=dev, dtype=i32)
        batch = ForwardBatch(
            input_ids=ids,
            positions=torch.full((B,), position, device=dev),
            out_slots=rows.long() * self.width + position,
            req_rows=rows,
            cached_lens=torch.full((B,), position, device=dev, dtype=i32),
            seq_lens=torch.full((B,), position + 1, device=dev, dtype=i32),
            q_starts=rows,
            q_lens=torch.ones(B, device=dev, dtype=i32),
            req_table=self.table.table,
            max_seq_len=position + 1,
            max_q_len=1,
            is_decode=True,
        )
        model.set_backend(self.backend)
        return model(batch)


def sample_text(model, pool: SequencePool, seqs: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """[seqs, length] ids sampled at temperature 1 from seeded random first tokens, all rows at once."""
    gen = torch.Generator(device=pool.device).manual_seed(seed)
    ids = torch.randint(3, vocab, (seqs, 1), generator=gen, device=pool.device)
    logits = pool.prefill(model, ids, all_logits=False)
    for position in range(1, length):
        nxt = torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=gen)  # [seqs, 1]
        ids = torch.cat((ids, nxt), dim=1)
        if position < length - 1:
            logits = pool.decode(model, nxt[:, 0], position)
    return ids
