"""The batched LoRA delta: y[t] += (x[t] A[s]^T) B[s]^T, s the adapter slot of token t's request.

Every adapter is stacked per layer (``worker.lora.adapter_set``): A [S, R, in], B [S, out, R],
slot 0 all zeros (no adapter), ranks below R padded with zero rows of A and zero columns of B,
so one formula serves every request of a batch whatever its adapter and rank. The base matmul
is not touched: the delta is added to its output.

Two implementations, chosen by device as the rest of the model's kernels are:
- PyTorch (CPU, and the reference the kernels are tested against): per distinct slot of the
  batch, its tokens gathered and multiplied, fp32 throughout (slot 0 skipped: its delta is 0);
- Triton (CUDA): a shrink (v = x A^T, [T, R] fp32) then an expand (y += v B^T), BGMV-style per
  token for a small decode (``worker.model.kernels.bgmv``), and over the tokens grouped by slot in
  blocks (``worker.model.kernels.bgmv_grouped``: an adapter's weights read once per block of its
  tokens, not once per token) for a decode of ``GROUPED_FROM`` tokens or more and for every
  prefill, in blocks of ``PREFILL_BLOCK_M`` tokens there. Both read the slots from device
  tensors and so run inside a captured CUDA graph. (SGMV, a program per request segment and row
  block with the grid sized by the longest prompt, served prefills until it measured slower:
  ``bench.engine.lora_kernels --prefill``, bench/RESULTS.md.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.model.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from worker.model.kernels.bgmv_grouped import TokenGroups
    from worker.model.kernels.lora_shards import Shards

# From this many decode tokens the grouped kernel serves: on an H100 at 100 adapters of rank 16 it
# took 0.84-0.98x BGMV's time at 64 tokens, 0.65-1.02x at 128, 0.21-0.32x at 768, 1-2x at 16
# (bench.engine.lora_kernels, bench/RESULTS.md).
GROUPED_FROM = 64
# A prefill's blocks: a prompt's tokens share one adapter, so blocks are full, and larger ones re-read
# each adapter's A and B fewer times; its shrink has blocks enough to split K less. On an H100, 3,000
# tokens over 64 adapters: 11.1 ms a step at 32 / 1024, 11.4 at 32 / 512, 13.1 at the decode's 16 /
# 512, SGMV 17.6 (bench.engine.lora_kernels --prefill, bench/RESULTS.md).
PREFILL_BLOCK_M, PREFILL_SPLIT_K = 32, 1024


def forward_groups(batch: ForwardBatch, num_slots: int) -> TokenGroups | None:
    """The forward's tokens grouped by slot where the grouped kernel will serve it (CUDA: a prefill,
    or a decode of enough tokens); done once a forward, before its layers (``AdapterSet.bind``)."""
    slots = batch.lora_slots
    if slots is None or not slots.is_cuda or (batch.is_decode and slots.shape[0] < GROUPED_FROM):
        return None
    from worker.model.kernels.bgmv_grouped import BLOCK_M, group_tokens

    if batch.is_decode:
        return group_tokens(slots, num_slots, BLOCK_M)
    return group_tokens(token_slots(batch), num_slots, PREFILL_BLOCK_M)


def token_slots(batch: ForwardBatch) -> torch.Tensor:
    """[T] each packed token's adapter slot (its request's ``lora_slots``, repeated q_lens times)."""
    assert batch.lora_slots is not None
    if batch.is_decode:
        return batch.lora_slots
    repeats = batch.q_lens.to(batch.lora_slots.device)
    # output_size: T is known on the host, so the repeat does not wait for the device to count it
    return torch.repeat_interleave(batch.lora_slots, repeats, dim=0, output_size=batch.num_tokens)


def lora_delta_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The delta [T, out] in fp32 for x [T, in], A [S, R, in], B [S, out, R], slots [T]."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32, device=x.device)
    for slot in slots.unique().tolist():
        if slot == 0:
            continue  # no adapter: zeros
        rows = (slots == slot).nonzero().squeeze(1)
        v = x[rows].float() @ a[slot].float().T  # [t, R]
        out[rows] = v @ b[slot].float().T  # [t, out]
    return out


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    batch: ForwardBatch,
    groups: TokenGroups | None = None,
    shards: Shards | None = None,
) -> torch.Tensor:
    """y [T, out] plus every token's delta (in place on CUDA; a new tensor on CPU). ``groups``: the
    forward's tokens grouped by slot (``forward_groups``), where the grouped kernel serves; ``shards``:
    a fused layer's block-diagonal B, whose zero blocks the kernels skip (the reference multiplies them)."""
    if not x.is_cuda:
        return y + lora_delta_ref(x, a, b, token_slots(batch)).to(y.dtype)
    assert batch.lora_slots is not None
    if groups is not None:
        from worker.model.kernels.bgmv_grouped import bgmv_grouped

        split_k = {} if batch.is_decode else {"split_k": PREFILL_SPLIT_K}  # a decode: the kernel's defaults
        bgmv_grouped(y, x, a, b, groups, shards=shards, **split_k)
    else:  # a decode below GROUPED_FROM: every prefill on CUDA has its groups (``forward_groups``)
        from worker.model.kernels.bgmv import bgmv

        assert batch.is_decode
        bgmv(y, x, a, b, batch.lora_slots, shards=shards)
    return y
