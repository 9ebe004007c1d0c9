"""Page-in job tables kept on the device: a page-in costs the host a lookup, not a walk of every shard.

A page-in writes an adapter's shards into a slot with one launch over a job table
(``worker.model.kernels.scatter_copy``). Building that table walks every shard of every layer
(``AdapterSet._pieces``: 448 pieces on Llama-3-8B, ~2.5 ms of slicing plus ~1.1 ms to tabulate them
on the sandbox's CPU) and uploads it; a prefill step of the 1,000-adapter run pages ~9 adapters in,
so ~30 ms of host time a step went there while the GPU waited for the step's forward.

The table depends only on the slot (its destinations), the layout of the adapter's host buffer (its
sources' offsets: ``LoraAdapter.layout``, which ``pack`` lays out in that order) and the layout of
the adapter the slot held before (which ranks past the new one's are zeroed). So it is built once
per (slot, previous layout, layout) and kept, with what the slot then holds (``written``, the ranks
the next table's zero fills start from). Adapters of one base model mostly share a layout (same
targets, same rank): the tables number about the slots. Bounded: the least recently used go past
``limit``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from worker.model.kernels.scatter_copy import Pieces, device_table

Layout = tuple  # LoraAdapter.layout: (module, per shard (A shape, B shape) or None), in the buffer's order


@dataclass(frozen=True)
class PageTable:
    table: torch.Tensor | None  # the job table on the device; None: nothing to write
    written: dict[str, list[int]]  # layer -> each shard's rank in the slot afterwards


class PageTables:
    def __init__(self, device: torch.device, limit: int):
        self.device, self.limit = device, limit
        self.tables: OrderedDict[tuple[int, Layout | None, Layout], PageTable] = OrderedDict()
        self.holds: dict[int, Layout] = {}  # slot -> the layout of the adapter written there last
        self.built = 0  # tables built (the rest of the page-ins were lookups)

    def get(
        self, slot: int, layout: Layout, flat: torch.Tensor, pieces: Callable[[], tuple[Pieces, dict[str, list[int]]]]
    ) -> PageTable:
        """The table that writes an adapter of ``layout`` (host buffer ``flat``) into ``slot``;
        ``pieces`` builds its pieces and the slot's ranks afterwards when none is kept yet."""
        key = (slot, self.holds.get(slot), layout)
        found = self.tables.get(key)
        if found is None:
            built, written = pieces()
            found = self.tables[key] = PageTable(device_table(built, flat, self.device), dict(written))
            self.built += 1
            while len(self.tables) > self.limit:
                self.tables.popitem(last=False)
        self.tables.move_to_end(key)
        self.holds[slot] = layout
        return found
