"""Many small 2-D copies (and zero fills) from one contiguous buffer, in one launch: a LoRA page-in.

Paging an adapter into a device slot (``worker.lora.adapter_set``) writes each shard's A rows and
B block into its layer's stacks: on Llama-3-8B, 32 layers x (qkv 3 + o 1 + gate_up 2 + down 1)
shards x (A, B) = 448 copies an adapter, B's into strided slices (a column block of [out, n R]),
which PyTorch copies from the host through a contiguous temporary: ~700 operations of ~10 µs of
host time each, ~7 ms an adapter and ~90 ms of a prefill step that pages 13 in (on an H100, the
1,000-adapter run's prefill steps took 146 ms; bench/RESULTS.md). Here the adapter's tensors lie in
one pinned host buffer (``worker.lora.adapter``): one DMA copies it whole into a device staging
buffer, and one kernel writes every piece from there into its place, so a page-in is three
operations (the DMA, the table's copy, the launch) whatever the model's depth.

A job is a row of the int64 table: (offset of its source in ``staging`` in elements, or -1 for a
zero fill; the destination's address; rows; columns; the destination's row stride), the source
contiguous [rows, columns], the destination's columns contiguous. Programs (job, part) walk a job's
elements ``PARTS`` apart, so a large job is shared by ``PARTS`` programs. Stream-ordered: a later
page-in's DMA into ``staging`` waits for this launch, on the same stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PARTS, BLOCK = 16, 1024
FIELDS = 5  # a job's int64 fields, in the order above
Pieces = list[tuple[torch.Tensor, torch.Tensor | None]]  # (destination 2-D view, its source in the host buffer or None)


@triton.jit
def _scatter(table, staging, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    job, part = tl.program_id(0), tl.program_id(1)
    row = table + job * 5
    src, rows, cols, stride = tl.load(row), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    dst = tl.load(row + 1).to(tl.pointer_type(staging.dtype.element_ty))  # an address in the stacks
    total = rows * cols
    for e0 in range(part * BLOCK, total, PARTS * BLOCK):
        e = e0 + tl.arange(0, BLOCK).to(tl.int64)
        inside = e < total
        source = src + e  # src -1: a zero fill, nothing read
        values = tl.load(staging + source, mask=inside & (source >= e), other=0.0)
        tl.store(dst + (e // cols) * stride + e % cols, values, mask=inside)


def job_table(pieces: Pieces, flat: torch.Tensor) -> torch.Tensor:
    """The host table of ``pieces``: (destination 2-D view, its source inside ``flat`` or None for
    zeros). Each source is a contiguous tensor of the destination's shape viewing ``flat``."""
    rows = []
    base, size = flat.data_ptr(), flat.element_size()
    for dst, src in pieces:
        assert dst.dim() == 2 and dst.stride(1) == 1 and dst.dtype == flat.dtype, (dst.shape, dst.stride())
        offset = -1
        if src is not None:
            assert src.shape == dst.shape and src.is_contiguous() and base <= src.data_ptr() < base + flat.nbytes
            offset = (src.data_ptr() - base) // size
        rows.append((offset, dst.data_ptr(), dst.shape[0], dst.shape[1], dst.stride(0)))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, FIELDS)


def device_table(pieces: Pieces, flat: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """``pieces``' job table on ``device`` (those with nothing to write left out); None: nothing to write.
    Built once per slot and layout and kept (``worker.lora.page_tables``)."""
    pieces = [(dst, src) for dst, src in pieces if dst.numel()]
    return job_table(pieces, flat).to(device) if pieces else None


def scatter_copy(table: torch.Tensor | None, flat: torch.Tensor, staging: torch.Tensor, copied: bool = False) -> None:
    """Write every piece of ``table`` (``device_table``: each piece's source a view of the host buffer
    ``flat``, or zeros) into its destination: ``flat`` copied into ``staging`` (same dtype, on the
    destinations' device, at least as large; ``copied``: it is there already), then one launch.
    Asynchronous on the current stream. None: nothing to write."""
    if table is None:
        return
    assert staging.dtype == flat.dtype and staging.numel() >= flat.numel() and flat.is_contiguous()
    if not copied:
        staging[: flat.numel()].copy_(flat.reshape(-1), non_blocking=True)  # pinned on a GPU: one DMA
    _scatter[(table.shape[0], PARTS)](table, staging, PARTS=PARTS, BLOCK=BLOCK)
