"""Each request's row on the runner, from ``start`` to ``finish``, and a group's fork.

A started request gets a row of the request -> token table (``worker.runner.req_table``) and
room for its slot ids, its LoRA adapter pinned on the device for as long as it holds the row
(``worker.lora.pins``), the row's token counts (penalties, ``min_new_tokens``) and, constrained,
its grammar's matcher (``worker.runner.grammar``). ``finish`` gives them back, with the request's
own slots (``worker.engine.kv_slots``); a group's prompt slots go with their last holder.

A group's prompt is prefilled once, by its leader; when it is complete the leader shares it
with the other samples (``fork``): their table rows get a copy of the leader's prompt
positions, not its K/V, and every sample takes the tokens its choice emitted before (a
requeued group), its counts and matcher rebuilt after them.
"""

from __future__ import annotations

import numpy as np

from worker.engine.kv_slots import KVSlots
from worker.engine.request import Req
from worker.lora.pins import AdapterPins
from worker.runner.grammar import Grammars
from worker.runner.penalties import TokenCounts
from worker.runner.req_table import ReqTable


class RequestRows:
    def __init__(
        self,
        table: ReqTable,
        slots: KVSlots,
        counts: TokenCounts,
        grammars: Grammars | None,
        adapters,
        pins: AdapterPins | None,
    ):
        self.table = table
        self.slots = slots
        self.counts = counts
        self.grammars = grammars  # None: this runner refuses constrained requests (no tokenizer)
        self.adapters = adapters  # worker.lora.adapter_set.AdapterSet, or None
        self.pins = pins

    def queued(self, req: Req) -> None:
        """``req`` was queued: begin what it needs that takes time off the loop (its grammar's compile,
        ``Grammars.prepare``). Not its adapter: a page-in on arrival evicts the idle adapter of some
        request queued before it (1,000 requests queued at once paged in ~1,000 adapters, each
        evicting the last); adapters are paged in as admission reaches their requests (``prepare``)."""
        if self.grammars is not None:
            self.grammars.prepare(req)

    def prepare(self, req: Req) -> bool:
        """Whether ``req`` can start now: False while its grammar compiles (``Grammars.prepare``), or
        while its LoRA adapter cannot be paged in (every adapter slot used by started requests)."""
        if req.msg.adapter is not None and self.pins is not None and not self.pins.page_in(req.msg.adapter):
            return False
        return self.grammars is None or self.grammars.prepare(req)

    def start(self, req: Req) -> None:
        if req.msg.adapter is not None and (self.adapters is None or req.msg.adapter not in self.adapters.slots):
            raise ValueError(f"{req.id}: LoRA adapter {req.msg.adapter!r} is not served by this worker")
        req.row = self.table.allocate_row()
        if req.msg.adapter is not None and self.pins is not None:
            self.pins.pin(req.row, req.msg.adapter)  # its adapter stays on the device until it ends
        req.slot_ids = np.empty(req.max_len, dtype=np.int64)
        req.num_cached = req.num_shared = 0
        self._start_counts(req)
        self._start_grammar(req)

    def _start_grammar(self, req: Req) -> None:
        if req.msg.params.constraint is None:
            return
        if self.grammars is None:
            raise ValueError(f"{req.id}: a constrained request needs a worker built with its tokenizer's grammars")
        self.grammars.start(req)

    def _start_counts(self, req: Req) -> None:
        """The row's token counts: prompt, and output so far (resumed or paused), for penalties."""
        params = req.msg.params
        if params.has_penalties or params.min_new_tokens:  # only they read the row's counts
            self.counts.start(req.row, req.msg.prompt_ids, req.output_ids)

    def finish(self, req: Req) -> None:
        """Free the request's row and own slots; a group's prompt slots go with their last holder."""
        self.slots.release(req)
        if self.pins is not None:
            self.pins.unpin(req.row)
        self.table.free_row(req.row)
        if self.grammars is not None:
            self.grammars.finish(req)
        req.row = None
        req.num_cached = req.num_shared = 0

    def fork(self, leader: Req, members: list[Req]) -> list[tuple[int, int, int]]:
        """Share the leader's (complete) prompt with ``members``: rows, not K/V, are copied.
        Each sample, the leader too, takes its choice's emitted tokens (a requeued group):
        they are uncached, prefilled by later steps on top of the shared prompt."""
        group, n = leader.group, len(leader.msg.prompt_ids)
        group.forked, group.prompt_slots = True, leader.slot_ids[:n].copy()
        self.slots.fork(leader)
        group.holders = 1 + len(members)
        leader.num_shared = n
        leader.take_emitted()
        if leader.output_ids:  # its row's counts and matcher were started from the prompt alone
            self._start_counts(leader)
            self._start_grammar(leader)
        for member in members:
            member.take_emitted()
            self.start(member)
            member.slot_ids[:n] = group.prompt_slots
            member.num_cached = member.num_shared = n
        return [(m.row, leader.row, n) for m in members]
