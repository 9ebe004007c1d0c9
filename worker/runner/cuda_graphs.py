"""Decode steps as CUDA graphs, one per batch-size bucket.

A decode step is dozens of small kernels per layer; replaying a captured
graph removes the launch gaps. Each bucket's graph reads its inputs from one
static ``[5, max_bs]`` int64 buffer (input ids, positions, pool slots, table
rows, LoRA adapter slots), filled by a single host->device copy per step, and writes logits into
one static ``[max_bs, vocab]`` buffer. A batch is padded up to its bucket:

| padded row | input id | position | slot      | row      | adapter | effect                          |
|------------|----------|----------|-----------|----------|---------|---------------------------------|
| real b     | last tok | cached_b | new slot  | its row  | its own | normal decode                   |
| padding    | 0        | 0        | hold_slot | hold_row | 0       | writes/reads only the hold slot |

A model with LoRA adapters (``model.lora``) is captured with the adapter row as its batch's
``lora_slots``: the BGMV kernels read it on the device, so one graph serves any mix of adapters.

Kernel grids depend on host integers fixed at capture: the batch size and
``max_seq_len`` (the table's width), so grids are sized for the longest
context and programs past a request's length exit early. Batches above the
largest bucket run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from worker.model.forward_batch import ForwardBatch
from worker.runner.req_table import ReqTable

log = logging.getLogger("lightq.worker")

ROWS = 5  # the static inputs: input ids, positions, pool slots, table rows, adapter slots


def default_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, every 16 up to 256 (LightLLM grows by 16 too), then every 64:
    padding wastes at most 15 (or 63) rows while the graph count stays small."""
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    mid = list(range(16, min(max_batch, 256) + 1, 16))
    large = list(range(320, max_batch + 1, 64))
    return sorted(set(small + mid + large + [max_batch]))


@torch.inference_mode()
def capture(step: Callable[[int], None], sizes: list[int]) -> dict[int, torch.cuda.CUDAGraph]:
    """A graph of ``step(size)`` per size, largest first so later graphs reuse its memory pool;
    each is run once first, outside the capture, so Triton compiles there."""
    graphs, pool = {}, None
    for size in sorted(sizes, reverse=True):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step(size)
        pool = graph.pool()
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs


class DecodeGraphs:
    def __init__(
        self, model, table: ReqTable, hold_slot: int, vocab_size: int, buckets: list[int], device: torch.device
    ):
        self.model = model
        self.table = table
        self.hold_slot = hold_slot
        self.buckets = sorted(buckets)
        self.max_bs = self.buckets[-1]
        self.inputs = torch.zeros((ROWS, self.max_bs), dtype=torch.int64, device=device)
        # Two pinned staging buffers, used in turn: an overlapped engine fills step n + 1's while
        # step n's copy may still be queued. Buffer reuse two steps later is safe because the engine
        # has landed step n's sampling (queued after that copy) before it plans step n + 2.
        self.hosts = [torch.zeros((ROWS, self.max_bs), dtype=torch.int64).pin_memory() for _ in range(2)]
        self._turn = 0
        self.logits = torch.empty((self.max_bs, vocab_size), dtype=torch.float32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def run(
        self,
        input_ids: np.ndarray | None,
        positions: np.ndarray,
        slots: np.ndarray,
        rows: np.ndarray,
        last_ids: torch.Tensor | None = None,
        lora_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """Logits [B, vocab] of one decode step; also records the new slots in the table.
        ``input_ids`` None: each row's input is ``last_ids[row]``, read on the device."""
        n = len(positions)
        bs = next(b for b in self.buckets if b >= n)
        staging = self.hosts[self._turn]
        self._turn ^= 1
        host = staging.numpy()
        host[0, :n] = 0 if input_ids is None else input_ids
        host[1, :n], host[2, :n], host[3, :n] = positions, slots, rows
        host[4, :n] = 0 if lora_slots is None else lora_slots
        host[:, n:bs] = self._padding()
        self.inputs[:, :bs].copy_(staging[:, :bs], non_blocking=True)
        if input_ids is None:
            assert last_ids is not None, "a decode with its ids on the device needs them"
            self.inputs[0, :n] = last_ids[self.inputs[3, :n]]
        self.graphs[bs].replay()
        return self.logits[:n]

    def _step(self, bs: int) -> None:
        """The captured work: table write, forward, logits into the static buffer."""
        input_ids, positions, slots, rows, adapters = self.inputs[:, :bs]
        self.table.table[rows, positions] = slots.to(torch.int32)
        positions32 = positions.to(torch.int32)
        ones = torch.ones_like(positions32)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_slots=slots,
            req_rows=rows.to(torch.int32),
            cached_lens=positions32,
            seq_lens=positions32 + 1,
            q_starts=torch.arange(bs, dtype=torch.int32, device=positions.device),
            q_lens=ones,
            req_table=self.table.table,
            max_seq_len=self.table.max_len,
            max_q_len=1,
            is_decode=True,
            lora_slots=adapters.to(torch.int32) if getattr(self.model, "lora", None) is not None else None,
        )
        self.logits[:bs].copy_(self.model.forward(batch))

    def _capture_all(self) -> None:
        self._pad_all()
        self.graphs = capture(self._step, self.buckets)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _padding(self) -> np.ndarray:
        """[ROWS, 1]: a padded row's inputs (the table above)."""
        return np.array([[0], [0], [self.hold_slot], [self.table.hold_row], [0]])

    def _pad_all(self) -> None:
        host = self.hosts[0].numpy()
        host[:] = self._padding()
        self.inputs.copy_(self.hosts[0])
