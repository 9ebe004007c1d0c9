"""A small prefill of one request as a CUDA graph, one per token-count bucket.

A serving step usually prefills one newcomer of a few hundred tokens. Its
eager forward waits on the host: on an H200 a 140-token prefill of the
Llama-3-8B shape took 12.6-14 ms of GPU time for ~4 ms of GEMM work, the
rest being gaps between ~350 kernel launches (bench/RESULTS.md). Replaying a
captured graph removes the gaps, as ``cuda_graphs.DecodeGraphs`` does for
decode steps.

The request's tokens are padded up to their bucket; every kernel grid is
fixed at capture by the bucket (its token count) and the table's width:

| token        | input id | position        | slot      | effect                               |
|--------------|----------|-----------------|-----------|--------------------------------------|
| real i < n   | its id   | cached + i      | its slot  | normal prefill                       |
| padding      | 0        | 0               | hold_slot | K/V land in the hold slot, never read |

The request's row, cached length and real token count live in a device
buffer, so attention masks the padding queries out and the logits come from
token n - 1. The table write happens before the replay, outside the graph.
A step with several requests, a group's fork, or more tokens than the
largest bucket runs eagerly.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from worker.model.forward_batch import ForwardBatch
from worker.runner.cuda_graphs import capture
from worker.runner.req_table import ReqTable

log = logging.getLogger("lightq.worker")

DEFAULT_BUCKETS = (32, 64, 128, 256, 512)


class PrefillGraphs:
    def __init__(
        self,
        model,
        table: ReqTable,
        hold_slot: int,
        vocab_size: int,
        device: torch.device,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        capture: bool = True,
    ):
        self.model, self.table, self.hold_slot = model, table, hold_slot
        self.buckets = sorted(buckets)
        self.max_tokens = self.buckets[-1]
        self.tokens = torch.zeros((3, self.max_tokens), dtype=torch.int64, device=device)  # ids, positions, slots
        self.request = torch.zeros(3, dtype=torch.int64, device=device)  # row, cached, real tokens
        self.logits = torch.empty((1, vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture_all()

    def can_run(self, num_requests: int, num_tokens: int, num_forks: int) -> bool:
        return num_requests == 1 and num_forks == 0 and 0 < num_tokens <= self.max_tokens

    def load(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, row: int, cached: int) -> int:
        """Fill the static buffers (padded); returns the bucket."""
        n = len(input_ids)
        bucket = next(b for b in self.buckets if b >= n)
        host = np.zeros((3, bucket), dtype=np.int64)
        host[0, :n], host[1, :n], host[2, :n] = input_ids, positions, slots
        host[2, n:] = self.hold_slot
        self.tokens[:, :bucket].copy_(torch.from_numpy(host), non_blocking=True)
        self.request.copy_(torch.tensor([row, cached, n], dtype=torch.int64), non_blocking=True)
        return bucket

    def run(
        self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, row: int, cached: int
    ) -> torch.Tensor:
        """Logits [1, vocab] of the request's last new token (its table entries are written already)."""
        self.graphs[self.load(input_ids, positions, slots, row, cached)].replay()
        return self.logits

    def step(self, bucket: int) -> None:
        """The captured work: the forward over the padded tokens, logits into the static buffer."""
        input_ids, positions, slots = self.tokens[:, :bucket]
        row, cached, n = (self.request[i : i + 1].to(torch.int32) for i in range(3))
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_slots=slots,
            req_rows=row,
            cached_lens=cached,
            seq_lens=cached + n,
            q_starts=torch.zeros_like(n),
            q_lens=n,
            req_table=self.table.table,
            max_seq_len=self.table.max_len,
            max_q_len=bucket,
            is_decode=False,
        )
        self.logits.copy_(self.model.forward(batch))

    def _capture_all(self) -> None:
        self.request.copy_(torch.tensor([self.table.hold_row, 0, 1]))  # capture on a harmless request
        self.tokens[2].fill_(self.hold_slot)
        self.graphs = capture(self.step, self.buckets)
        log.info("captured prefill CUDA graphs for %s tokens", self.buckets)
