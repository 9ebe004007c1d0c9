"""``Staging``: the device buffers a LoRA adapter's host buffer lands in before its slot is written.

A page-in is a DMA of the adapter's one pinned host buffer (``worker.lora.adapter.pack``) into a
staging buffer, then one launch scattering its pieces into the slot (``scatter_copy``). The DMA is
the slow part (84 MB for Llama-3-8B at rank 16, a few ms over PCIe) and on the model's stream the
GPU waits for it. With every slot taken, the requests waiting for one are known before a slot frees:
``prefetch`` starts such an adapter's DMA on a copy stream of its own into one of ``ahead`` spare
buffers while decode steps run, so when its slot frees the page-in is the scatter alone.

Ordering, all by CUDA events: the scatter waits for its buffer's DMA (``write``), and a buffer's next
DMA waits for the scatter that last read it. Hundreds of waiting requests ask each admission pass, so
an asking with no free buffer costs a lookup: staged adapters keep their buffers (the first askers
are the next to start) until paged in, forgotten (unloaded), or left unused while ``STALE`` times
``ahead`` other page-ins went by (their requests were cancelled, say): then the oldest is given up.
Without CUDA (the tests on a CPU) the same bookkeeping runs with plain copies.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from worker.model.kernels.scatter_copy import scatter_copy

STALE = 4


class Staging:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, ahead: int):
        self.direct = torch.empty(numel, dtype=dtype, device=device)  # page-ins nobody prefetched
        self.ahead = [torch.empty(numel, dtype=dtype, device=device) for _ in range(ahead)]
        # name -> (buffer, its DMA's event, page-ins written when it was staged), oldest first
        self.staged: OrderedDict[str, tuple[int, torch.cuda.Event | None, int]] = OrderedDict()
        self.free = list(range(ahead))
        self.read: list[torch.cuda.Event | None] = [None] * ahead  # per buffer: the scatter that last read it
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.writes = self.prefetched = self.used = 0  # page-ins, DMAs started ahead, page-ins that found theirs

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in [self.direct, *self.ahead])

    def prefetch(self, name: str, flat: torch.Tensor) -> None:
        """Start copying adapter ``name``'s host buffer into a free spare buffer, unless it is staged
        already or none is free (a stale one is freed: the module's docstring)."""
        if name in self.staged or not self.ahead:
            return
        if not self.free:
            oldest = next(iter(self.staged))
            if self.writes - self.staged[oldest][2] < STALE * len(self.ahead):
                return
            self.forget(oldest)
        buffer = self.free.pop()
        target = self.ahead[buffer][: flat.numel()]
        event = None
        if self.stream is None:
            target.copy_(flat.reshape(-1))
        else:
            with torch.cuda.stream(self.stream):
                if self.read[buffer] is not None:
                    self.stream.wait_event(self.read[buffer])
                target.copy_(flat.reshape(-1), non_blocking=True)  # pinned: a DMA beside the model's stream
                event = torch.cuda.Event()
                event.record(self.stream)
        self.staged[name] = (buffer, event, self.writes)
        self.prefetched += 1

    def write(self, name: str, table: torch.Tensor | None, flat: torch.Tensor) -> None:
        """Adapter ``name`` into its slot by its job table on the device (``scatter_copy``; None:
        nothing to write), from its staged copy if ``prefetch`` made one."""
        self.writes += 1
        staged = self.staged.pop(name, None)
        if staged is None:
            scatter_copy(table, flat, self.direct)
            return
        buffer, done, _ = staged
        self.free.append(buffer)  # its next DMA waits for this scatter (``read``)
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
        scatter_copy(table, flat, self.ahead[buffer], copied=True)
        self.used += 1
        if self.stream is not None:
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream())
            self.read[buffer] = read

    def forget(self, name: str) -> None:
        staged = self.staged.pop(name, None)
        if staged is not None:
            self.free.append(staged[0])
