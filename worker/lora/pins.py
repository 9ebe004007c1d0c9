"""``AdapterPins``: the LoRA adapters started requests run with, and paging one in for a request
about to start.

A started request pins its adapter: it keeps its device slot until the request ends. A waiting
request's adapter is paged in (``AdapterSet.make_resident``) into a free slot or one holding an
adapter no started request uses. With a thousand adapters over a few dozen slots, hundreds of
waiting requests may ask in one admission pass while every slot is pinned: each asking meant a walk
of the slots checking every pin (O(slots^2): 37 ms a pass of 1,000 askers over 64 slots on a sandbox
core, twice a decode step). After one refusal, the others are refused at once until a pin is
released or the set of adapters changes, since nothing else frees a slot: a pass costs O(waiting).

Refilling in batches (``AdapterSet.page_batch``, --lora_page_batch): with every run-time slot pinned,
requests end one at a time, and paging in the next adapter as each slot frees made a prefill step
of a request or two beside the running batch again and again (1,000 adapters over 64 slots on an
H100: 506 prefill steps, 29.4 s, 0.40x of the base model; 74 steps, 13.7 s, 0.475x with 8 at a
time; bench/RESULTS.md). So after
a refusal nothing is paged in until ``page_batch`` run-time slots are unpinned; then the waiting
requests start together, in one prefill step. Below full occupancy nothing changes.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.lora.adapter_set import AdapterSet


class AdapterPins:
    def __init__(self, adapters: AdapterSet):
        self.adapters = adapters
        self.rows: dict[int, str] = {}  # table row -> the adapter its started request runs with
        self.counts: Counter[str] = Counter()  # adapter -> started requests running with it
        self.releases = 0  # pins released so far (a slot may have become free)
        self._full_at: tuple[int, int] | None = None  # (adapters.changes, releases) at the last refusal
        self._refilling = False  # refused since the last batch was paged in: wait for page_batch free slots
        self._unpinned: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (stamp, run-time slots no pin holds)

    def page_in(self, name: str) -> bool:
        """Whether adapter ``name`` is on the device now, paged in if a slot can take it; True for a
        name this worker does not serve (``ModelRunner.start`` refuses it). Refused, its copy to the
        device starts while it waits (``AdapterSet.prefetch``)."""
        if self._paged_in(name):
            return True
        self.adapters.prefetch(name)
        return False

    def _paged_in(self, name: str) -> bool:
        adapters, stamp = self.adapters, (self.adapters.changes, self.releases)
        if name in adapters.host and name not in adapters.slots:
            if self._full_at == stamp:
                return False  # every slot was pinned at the last asking, and none has been freed since
            if self._refilling and self._free_runtime_slots(stamp) < adapters.page_batch:
                return False
            self._refilling = False
        if adapters.make_resident(name, self.counts):
            return True
        self._full_at = stamp
        self._refilling = True
        return False

    def _free_runtime_slots(self, stamp: tuple[int, int]) -> int:
        """Run-time slots no started request pins (free, or holding an adapter idle), once a stamp."""
        if self._unpinned[0] != stamp:
            pinned = sum(1 for name in self.counts if name in self.adapters.host)
            self._unpinned = (stamp, self.adapters.spare - pinned)
        return self._unpinned[1]

    def pin(self, row: int, name: str) -> None:
        self.rows[row] = name
        self.counts[name] += 1

    def unpin(self, row: int) -> None:
        name = self.rows.pop(row, None)
        if name is None:
            return
        self.counts[name] -= 1
        if not self.counts[name]:
            del self.counts[name]
        self.releases += 1
