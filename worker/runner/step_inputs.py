"""One forward's inputs: on the host (``StepInputs``), then on the device (``forward_batch``).

``StepInputs`` holds a step's host arrays: ``ModelRunner.forward`` writes the request table from
them and runs the model, and under tensor parallelism rank 0 hands them to the other ranks first
(``worker.runner.tp``), which run the same forward from them. ``forward_batch`` queues their
copies to the device as the model's ``ForwardBatch`` (nothing waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from worker.model.forward_batch import ForwardBatch


@dataclass(frozen=True)
class StepInputs:
    """One forward's inputs on the host: all a tensor-parallel follower needs to run it too."""

    input_ids: np.ndarray  # [T] int64, packed new tokens
    positions: np.ndarray  # [T] their positions
    slots: np.ndarray  # [T] their pool slots
    rows: np.ndarray  # [B] request-table rows
    cached: np.ndarray  # [B] tokens of each request already in the pool
    q_lens: np.ndarray  # [B] new tokens of each request
    is_decode: bool
    # [F, 3] (member row, leader row, prompt length): table[member, :len] = table[leader, :len],
    # after this step's writes (prefill steps only).
    forks: np.ndarray = field(default_factory=lambda: np.empty((0, 3), dtype=np.int64))
    # [P, 3] (row, position, slot): cached prefixes written into new rows before this step's tokens.
    prefix: np.ndarray = field(default_factory=lambda: np.empty((0, 3), dtype=np.int64))
    # [N] packed tokens to return logits for (None: each request's last); prompt logprobs, --tp 1 only.
    logit_index: np.ndarray | None = None
    # A decode whose input ids are its rows' last sampled ids, still on the device (``last_ids``;
    # ``input_ids`` is then empty): the overlapped engine launched it before landing them. --tp 1 only.
    ids_on_device: bool = False
    # [B] each request's LoRA adapter slot (worker.lora.adapter_set; 0: none); None: no adapters here.
    lora_slots: np.ndarray | None = None


def forward_batch(
    step: StepInputs, device: torch.device, last_ids: torch.Tensor, req_table: torch.Tensor
) -> ForwardBatch:
    """``step`` as the model's batch on ``device``; ``last_ids``: per table row, the id its last
    sampling drew (``ModelRunner.last_ids``); ``req_table``: the request -> token table."""

    def dev(values: np.ndarray, dtype=torch.int32) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device, dtype=dtype, non_blocking=True)

    seq_lens = step.cached + step.q_lens
    q_starts = np.concatenate([[0], np.cumsum(step.q_lens)[:-1]])
    rows_on_device = dev(step.rows)
    return ForwardBatch(
        # a decode launched before its input ids landed reads them where the sampler left them
        input_ids=last_ids[rows_on_device] if step.ids_on_device else dev(step.input_ids, torch.int64),
        positions=dev(step.positions, torch.int64),
        out_slots=dev(step.slots, torch.int64),
        req_rows=rows_on_device,
        cached_lens=dev(step.cached),
        seq_lens=dev(seq_lens),
        q_starts=dev(q_starts),
        q_lens=dev(step.q_lens),
        req_table=req_table,
        max_seq_len=int(seq_lens.max()),
        max_q_len=int(step.q_lens.max()),
        is_decode=step.is_decode,
        logit_index=None if step.logit_index is None else dev(step.logit_index, torch.int64),
        lora_slots=None if step.lora_slots is None else dev(step.lora_slots),
    )
