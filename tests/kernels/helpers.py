"""Random batches and pools for the kernel tests.

Everything is fresh random data; outputs are NaN-poisoned before a kernel
runs, and pool slots no request owns are NaN too, so an unwritten output or
a read past a request's tokens shows up as NaN in the result.
"""

from __future__ import annotations

import pytest
import torch

from worker.model.forward_batch import ForwardBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# bf16 only on the GPU: the interpreter is unreliable for it.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=[pytest.mark.gpu, needs_cuda], id="bfloat16"),
]

# (atol, rtol) per dtype. fp32 allows for tf32 in tl.dot on the GPU.
TOLERANCES = {torch.float32: (2e-3, 2e-3), torch.float16: (5e-3, 5e-3), torch.bfloat16: (3e-2, 3e-2)}


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol_rtol: tuple[float, float] | None = None) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} of {out.numel()} elements unwritten or NaN"
    atol, rtol = atol_rtol or TOLERANCES[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def make_batch(
    q_lens: list[int], cached_lens: list[int], table_width: int | None = None, spare_slots: int = 7
) -> ForwardBatch:
    """A batch over a pool of sum(seq_lens) + spare_slots slots, the last (the
    hold slot) included as num_slots. Slots are a random permutation and rows
    are scattered, so nothing is contiguous by luck. Table entries past a
    request's length point at the hold slot."""
    batch_size = len(q_lens)
    seq_lens = [q + c for q, c in zip(q_lens, cached_lens)]
    num_slots = sum(seq_lens) + spare_slots
    width = table_width or max(seq_lens) + 3
    perm = torch.randperm(num_slots, dtype=torch.int32)
    rows = torch.randperm(batch_size + 2)[:batch_size]
    table = torch.full((batch_size + 3, width), num_slots, dtype=torch.int32)
    out_slots, positions, used = [], [], 0
    for b in range(batch_size):
        table[rows[b], : seq_lens[b]] = perm[used : used + seq_lens[b]]
        used += seq_lens[b]
        out_slots.append(table[rows[b], cached_lens[b] : seq_lens[b]])
        positions.append(torch.arange(cached_lens[b], seq_lens[b]))
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    tensors = dict(
        input_ids=torch.randint(0, 1000, (sum(q_lens),)),
        positions=torch.cat(positions),
        out_slots=torch.cat(out_slots),
        req_rows=rows.to(torch.int32),
        cached_lens=torch.tensor(cached_lens, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        q_starts=(torch.cumsum(q_lens_t, 0) - q_lens_t).to(torch.int32),
        q_lens=q_lens_t,
        req_table=table,
    )
    return ForwardBatch(
        **{k: v.to(DEVICE) for k, v in tensors.items()},
        max_seq_len=max(seq_lens),
        max_q_len=max(q_lens),
        is_decode=all(q == 1 for q in q_lens),
    )


def make_pool(
    batch: ForwardBatch, num_kv_heads: int, head_dim: int, dtype: torch.dtype, poison_new: bool = False
) -> torch.Tensor:
    """Random pool layer [num_slots + 1, 2 * Hkv, D]; slots no request owns (the
    hold slot included) are NaN, and so are this step's new slots if poison_new."""
    num_slots = int(batch.req_table.max())  # the hold slot: make_batch's spare rows hold it
    pool = torch.randn(num_slots + 1, 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    owned = torch.zeros(num_slots + 1, dtype=torch.bool, device=DEVICE)
    for b in range(batch.num_requests):
        owned[batch.req_table[batch.req_rows[b], : batch.seq_lens[b]].long()] = True
    if poison_new:
        owned[batch.out_slots.long()] = False
    pool[~owned] = float("nan")
    return pool
