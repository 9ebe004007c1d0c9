"""Turns requests into forward passes and sampled tokens.

It owns the TokenAttention bookkeeping on the device side: pool slots are
taken from the ``TokenPool`` for every new token, recorded in the request
-> token table, and handed back when the request ends (a request's row,
from ``start`` to ``finish``: ``worker.runner.request_rows``). Decode steps go
through CUDA graphs when a ``DecodeGraphs`` is attached (GPU), else eager.

Every forward goes through ``forward(step)`` with the step's host arrays
(``StepInputs``, ``worker.runner.step_inputs``): it writes the table and runs the model. Under tensor
parallelism rank 0's runner has ``on_forward`` set (``worker.runner.tp``), which
hands each step to the other ranks first; they call ``forward`` with it.

A group's prompt is prefilled once, by its leader; the step that completes
it also forks the other samples (``prefill``'s ``forks``): their table rows
get a copy of the leader's prompt positions (``StepInputs.forks``, so
tensor-parallel followers copy too), and each samples its first token from
the leader's last-position logits. No K/V is copied.

Constrained samples (``grammars``, ``worker.runner.grammar``) get their
matcher with their row (``start``; rebuilt after the emitted tokens on a
fork); a step's mask is filled while its forward runs (after the launch),
and the engine advances the matchers (``accept``) when it lands the tokens.

Nothing here waits for the device: a forward and its sampling are queued,
and the sampled ids come back as a ``PendingSampled`` the engine lands when
it needs them (``worker.engine.engine``). A decode is two calls so that the
engine can land the previous step between them (``forward_decode``, then
``sample_decode``): its input ids are the last sampled ids of each row,
read on the device (``last_ids``) when the host has not seen them yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.kv_slots import KVSlots
from worker.engine.radix_cache import NoCache, PrefixCache
from worker.engine.request import GrammarStep, Req, sampling_after_prefill
from worker.engine.token_pool import TokenPool
from worker.lora.pins import AdapterPins
from worker.runner import prompt_logprobs
from worker.runner.grammar import GrammarMask, Grammars
from worker.runner.penalties import TokenCounts
from worker.runner.req_table import ReqTable
from worker.runner.request_rows import RequestRows
from worker.runner.sampler import PendingSampled, RowParams, SamplingBatch, launch_sample
from worker.runner.step_inputs import StepInputs, forward_batch


@dataclass(frozen=True)
class DecodeForward:
    """A launched decode forward, waiting for its sampling (``ModelRunner.sample_decode``)."""

    reqs: list[Req]
    rows: np.ndarray  # their table rows at launch (a request released since no longer has its own)
    logits: torch.Tensor


class ModelRunner:
    def __init__(
        self,
        model,
        pool: TokenPool,
        table: ReqTable,
        vocab_size: int,
        device: torch.device,
        eos_ids: set[int] = frozenset(),
        graphs=None,
        prefill_graphs=None,
        grammars: Grammars | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        self.model = model
        self.pool = pool
        # Every slot is taken and given back through ``slots``; a prefix cache (None: off) keeps
        # ended requests' K/V for later ones (worker.engine.kv_slots).
        self.slots = KVSlots(pool, prefix_cache if prefix_cache is not None else NoCache(pool))
        self.table = table
        self.vocab_size = vocab_size
        self.device = device
        self.graphs = graphs  # worker.runner.cuda_graphs.DecodeGraphs or None
        self.prefill_graphs = prefill_graphs  # worker.runner.prefill_graphs.PrefillGraphs or None
        self.grammars = grammars  # None: this runner refuses constrained requests (no tokenizer)
        self.on_forward = None  # tensor parallel, rank 0: StepInputs -> None, called before each forward
        # Per table row token counts, for penalties and min_new_tokens (one row per request).
        self.counts = TokenCounts(table.hold_row, vocab_size, eos_ids, device)
        # The last step's parameter tensors, keyed by its samples in order: decode steps of an
        # unchanged batch reuse them (a sample's parameters never change while it runs).
        self._row_params: tuple[tuple, RowParams | None] = ((), None)
        # Per table row, the id its last sampling drew: the next decode's input (see ``StepInputs.ids_on_device``).
        self.last_ids = torch.zeros(table.hold_row + 1, dtype=torch.int64, device=device)
        self.adapters = getattr(model, "lora", None)  # worker.lora.adapter_set.AdapterSet, or None
        self.pins = AdapterPins(self.adapters) if self.adapters is not None else None
        # Each request's row, from start to finish, and a group's fork (worker.runner.request_rows).
        self.req_rows = RequestRows(table, self.slots, self.counts, grammars, self.adapters, self.pins)

    def lora_slots(self, reqs: list[Req]) -> np.ndarray | None:
        """[B] each request's adapter slot, None when this worker serves no adapter (a request naming one
        it does not serve was refused at ``start``)."""
        if self.adapters is None:
            return None
        return np.fromiter((self.adapters.slot(r.msg.adapter) for r in reqs), dtype=np.int64, count=len(reqs))

    def queued(self, req: Req) -> None:
        """``req`` was queued: what it needs that takes time starts off the loop (``RequestRows.queued``)."""
        self.req_rows.queued(req)

    def prepare(self, req: Req) -> bool:
        """Whether ``req`` can start now (``RequestRows.prepare``)."""
        return self.req_rows.prepare(req)

    def start(self, req: Req) -> None:
        """Give ``req`` its table row, adapter pin, token counts and matcher (``RequestRows.start``)."""
        self.req_rows.start(req)

    def finish(self, req: Req) -> None:
        """Free the request's row and own slots; a group's prompt slots go with their last holder."""
        self.req_rows.finish(req)

    @torch.inference_mode()
    def forward_decode(self, reqs: list[Req], ids_known: bool = True) -> DecodeForward:
        """Launch one decode forward (all prefilled): each request feeds its last token. With
        ``ids_known`` False some of those are not on the host yet: they are read on the device."""
        slots = self.slots.allocate(len(reqs))
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        positions = np.fromiter((r.num_cached for r in reqs), dtype=np.int64, count=len(reqs))
        if ids_known:
            input_ids = np.fromiter((r.output_ids[-1] for r in reqs), dtype=np.int64, count=len(reqs))
        else:
            input_ids = np.empty(0, dtype=np.int64)
        for req, slot in zip(reqs, slots):
            req.slot_ids[req.num_cached] = slot
            req.num_cached += 1
        ones = np.ones(len(reqs), dtype=np.int64)
        step = StepInputs(
            input_ids,
            positions,
            slots,
            rows,
            positions,
            ones,
            True,
            ids_on_device=not ids_known,
            lora_slots=self.lora_slots(reqs),
        )
        return DecodeForward(reqs, rows, self.forward(step))

    @torch.inference_mode()
    def sample_decode(self, launched: DecodeForward) -> PendingSampled:
        """Queue the sampling of a launched decode (its grammar masks from the matchers as they are now)."""
        mask = self._mask(launched.reqs)  # on a GPU, this host work overlaps the forward
        return self._sample(launched.logits, launched.reqs, launched.rows, mask)

    def accept(self, reqs: list[Req], ids: list[int]) -> list[GrammarStep]:
        """Landed tokens advance their samples' grammars; per row, what the token did to its grammar."""
        if self.grammars is None:
            return [GrammarStep.OPEN] * len(reqs)
        return self.grammars.accept(reqs, ids)

    @torch.inference_mode()
    def prefill(
        self, reqs: list[Req], num_new: list[int], completing: list[Req], forks: dict[Req, list[Req]] | None = None
    ) -> PendingSampled:
        """Feed ``num_new[i]`` uncached tokens of each request; sample for those in ``completing``
        and, right after each leader in ``forks`` (which must complete), for its new members."""
        forks = forks or {}
        slots = self.slots.allocate(sum(num_new))
        cached = np.array([r.num_cached for r in reqs], dtype=np.int64)
        q_lens = np.array(num_new, dtype=np.int64)
        input_ids: list[int] = []
        offset = 0
        for req, n, start in zip(reqs, num_new, cached):
            new = slots[offset : offset + n]
            req.slot_ids[start : start + n] = new
            input_ids.extend(req.all_ids[start : start + n])
            req.num_cached += n
            offset += n
        positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cached, q_lens)])
        rows = np.array([r.row for r in reqs], dtype=np.int64)
        prefix = self.slots.prefix_writes(reqs)
        for req in completing:  # before the fork: a leader's shared prompt moves to its group whole
            self.slots.share(req)
        copies = [c for leader, members in forks.items() for c in self.req_rows.fork(leader, members)]
        pairs = sampling_after_prefill(completing, forks)  # after the fork, which sets num_uncached
        index, last_rows = prompt_logprobs.logit_index(reqs, num_new)
        logits = self.forward(
            StepInputs(
                np.array(input_ids, dtype=np.int64),
                positions,
                slots,
                rows,
                cached,
                q_lens,
                False,
                np.array(copies, dtype=np.int64).reshape(-1, 3),
                prefix,
                index,
                lora_slots=self.lora_slots(reqs),
            )
        )
        mask = self._mask([r for _, r in pairs])  # after the launch, before anything waits on the GPU
        if index is not None:  # every token's logits of the requests that asked: their prompt's logprobs
            prompt_logprobs.gather(reqs, num_new, cached, logits)
            logits = logits[torch.from_numpy(last_rows).to(logits.device)]
        if not pairs:  # nothing completed, or only samples that resume after emitted tokens
            return PendingSampled.none()
        # Each completing request samples from its own last logits, a fork's members from their leader's
        # (those that resume after emitted tokens do not sample yet: see sampling_after_prefill).
        position = {r: i for i, r in enumerate(reqs)}
        sampling = [r for _, r in pairs]
        sample_rows = np.array([r.row for r in sampling], dtype=np.int64)
        return self._sample(logits[[position[source] for source, _ in pairs]], sampling, sample_rows, mask)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Table writes, then the forward (a CUDA graph for a decode that fits one): logits [B, vocab]."""
        if self.on_forward is not None:
            self.on_forward(step)
        if step.is_decode and self.graphs is not None and self.graphs.can_run(len(step.rows)):
            ids = None if step.ids_on_device else step.input_ids
            return self.graphs.run(ids, step.positions, step.slots, step.rows, self.last_ids, step.lora_slots)
        if step.is_decode:
            self.table.write_scattered(step.rows, step.positions, step.slots)
        else:  # every new token's slot in one indexed write (a mixed step has a row per decoding request)
            if len(step.positions) and int(step.positions.max()) >= self.table.max_len:
                raise ValueError(f"position {int(step.positions.max())} past the table's {self.table.max_len}")
            if len(step.prefix):  # a new row's cached prefix, before its first tokens
                self.table.write_scattered(step.prefix[:, 0], step.prefix[:, 1], step.prefix[:, 2])
            self.table.write_scattered(np.repeat(step.rows, step.q_lens), step.positions, step.slots)
            for member, leader, n in step.forks.tolist():
                self.table.table[member, :n] = self.table.table[leader, :n]
            graphs = self.prefill_graphs
            if (
                graphs is not None
                and step.logit_index is None
                and (step.lora_slots is None or not step.lora_slots.any())  # captured without adapters
                and graphs.can_run(len(step.rows), len(step.input_ids), len(step.forks))
            ):
                return graphs.run(step.input_ids, step.positions, step.slots, int(step.rows[0]), int(step.cached[0]))
        return self.model.forward(forward_batch(step, self.device, self.last_ids, self.table.table))

    def _mask(self, reqs: list[Req]) -> GrammarMask | None:
        return self.grammars.mask(reqs) if self.grammars is not None and reqs else None

    def _sample(
        self, logits: torch.Tensor, reqs: list[Req], rows: np.ndarray, mask: GrammarMask | None = None
    ) -> PendingSampled:
        """Queue the sampling of ``reqs`` (table ``rows`` as at the launch); the ids also go to
        ``last_ids``, where the next decode reads them."""
        params = [r.msg.params for r in reqs]
        key = tuple((r.id, r.choice) for r in reqs)
        if key != self._row_params[0]:
            self._row_params = (key, RowParams.build(params, self.vocab_size, self.device))
        batch = SamplingBatch.build(
            params,
            self.vocab_size,
            self.device,
            rows=rows.tolist(),
            output_lens=[len(r.output_ids) for r in reqs],
            fixed=self._row_params[1],
            grammar=mask,
        )
        pending = launch_sample(logits, batch, self.counts)
        assert batch.rows is not None
        self.last_ids[batch.rows] = pending.ids
        return pending
