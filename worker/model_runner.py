"""Turns a list of requests into one forward pass and its sampled tokens.

It owns the TokenAttention bookkeeping on the device side: pool slots are
taken from the ``TokenPool`` for every new token, recorded in the request
-> token table, and handed back when the request ends.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.forward_batch import ForwardBatch
from worker.req_table import ReqTable
from worker.request import Req
from worker.sampler import SamplingBatch, sample
from worker.token_pool import TokenPool


class ModelRunner:
    def __init__(self, model, pool: TokenPool, table: ReqTable, vocab_size: int, device: torch.device):
        self.model = model
        self.pool = pool
        self.table = table
        self.vocab_size = vocab_size
        self.device = device

    def start(self, req: Req) -> None:
        req.row = self.table.allocate_row()
        req.slot_ids = np.empty(req.max_tokens_needed, dtype=np.int64)
        req.num_cached = 0

    def finish(self, req: Req) -> None:
        self.pool.free(req.slot_ids[:req.num_cached])
        self.table.free_row(req.row)
        req.row = None
        req.num_cached = 0

    @torch.inference_mode()
    def forward(self, reqs: list[Req], is_decode: bool) -> tuple[list[int], list[float]]:
        batch = self._prepare(reqs, is_decode)
        logits = self.model.forward(batch)  # [B, V] fp32
        params = SamplingBatch.build([r.msg.params for r in reqs], self.vocab_size, self.device)
        return sample(logits, params)

    def _prepare(self, reqs: list[Req], is_decode: bool) -> ForwardBatch:
        q_lens = np.array([r.num_uncached for r in reqs], dtype=np.int64)
        cached = np.array([r.num_cached for r in reqs], dtype=np.int64)
        slots = self.pool.allocate(int(q_lens.sum()))
        input_ids, positions = [], []
        offset = 0
        for req, n, start in zip(reqs, q_lens, cached):
            new = slots[offset:offset + n]
            req.slot_ids[start:start + n] = new
            if not is_decode:
                self.table.write(req.row, int(start), new)
            input_ids.extend(req.all_ids[start:])
            positions.extend(range(start, start + n))
            req.num_cached += int(n)
            offset += int(n)
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        if is_decode:
            self.table.write_scattered(rows, cached, slots)
        return self._to_device(input_ids, positions, slots, rows, cached, q_lens, is_decode)

    def _to_device(self, input_ids, positions, slots, rows, cached, q_lens, is_decode) -> ForwardBatch:
        def dev(values, dtype=torch.int32) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values), dtype=dtype).to(self.device, non_blocking=True)

        seq_lens = cached + q_lens
        q_starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]])
        return ForwardBatch(
            input_ids=dev(input_ids, torch.int64), positions=dev(positions, torch.int64),
            out_slots=dev(slots, torch.int64), req_rows=dev(rows), cached_lens=dev(cached),
            seq_lens=dev(seq_lens), q_starts=dev(q_starts), q_lens=dev(q_lens),
            req_table=self.table.table, max_seq_len=int(seq_lens.max()), max_q_len=int(q_lens.max()),
            is_decode=is_decode,
        )
