"""``AdapterSet``: every adapter a worker serves, stacked per layer, and the batch they run on.

Slots (the index a request's adapter has in every stack):

| slot    | what                          | A and B rows                    |
|---------|-------------------------------|---------------------------------|
| 0       | no adapter (the base model)   | zeros: its delta is 0           |
| 1 .. N  | --lora_modules, in their order | the adapter's, zero-padded to R |
| N+1 ..  | --max_loras run-time slots     | a loaded adapter's, or unused   |

Per adapted layer with n shards (qkv: 3, gate_up: 2, others 1) and R the largest rank any
adapter has on it, A is [S, n R, in] and B [S, out, n R]: shard k's A rows are k R .. k R + r,
and its B block sits at the shard's output rows and the same R columns, zero elsewhere (block
diagonal). One shrink and one expand then serve a fused layer, at the cost of multiplying the
zero blocks (n times the expand's work); a per-shard expand would save that (SGLang's).

--lora_modules' adapters fill slots 1..N at start. With --max_loras M, M more slots wait for
adapters loaded at run time (``add``, from ``worker.lora.runtime``), each stack then at least
--max_lora_rank wide on every adaptable layer, allocated once: the stacks never move, so captured
CUDA graphs stay valid, and a run-time load is a copy into a free slot. An unloaded adapter keeps
its slot (``retiring``) until no request uses it, then ``release`` frees it. Every adapter loaded
is on the device: no paging, no eviction (not in this slice).
The forward binds its batch (``bind``) so each ``LoraLinear`` reads the batch's slots; binding
is scoped and never nested.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shared.model_files import load_config, resolve
from worker.lora.adapter import AdapterError, LoraAdapter, load_adapter, parse_spec
from worker.lora.linear import LoraLinear
from worker.model.forward_batch import ForwardBatch
from worker.model.layers import Linear
from worker.model.models import model_class


class NoFreeSlot(AdapterError):
    """Every slot holds an adapter: one may free when an unloaded adapter's requests end."""


class AdapterSet:
    """``adapters`` in slots 1..N; ``spare`` more slots for adapters loaded at run time (``add``),
    each as large as ``rank`` on every adaptable layer (see the module's docstring)."""

    def __init__(self, adapters: list[LoraAdapter], spare: int = 0, rank: int = 0):
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}
        self.retiring: set[str] = set()  # unloaded, kept in their slots while requests still use them
        self.num_slots = len(adapters) + spare + 1
        self.spare_rank = rank if spare else 0
        self.max_rank = max([a.rank for a in adapters] + [self.spare_rank])
        self.bound: ForwardBatch | None = None  # set by ``bind`` for one forward
        self.nbytes = 0  # the stacks' device memory, once installed
        self.layers: dict[str, LoraLinear] = {}  # adapted layer name -> its wrapper (``install``)
        self._adapters = adapters

    @property
    def names(self) -> list[str]:
        """The adapters new requests may name (those retiring are not), by slot."""
        return [name for name, _ in sorted(self.slots.items(), key=lambda kv: kv[1]) if name not in self.retiring]

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: 0, the base model); KeyError when not served here.
        A retiring adapter keeps its slot for the requests that still run with it."""
        if name is None:
            return 0
        if name not in self.slots:
            raise KeyError(f"LoRA adapter {name!r} is not served by this worker (it serves {self.names})")
        return self.slots[name]

    @contextmanager
    def bind(self, batch: ForwardBatch) -> Iterator[None]:
        assert self.bound is None, "an adapter batch is already bound: forwards never nest"
        self.bound = batch
        try:
            yield
        finally:
            self.bound = None

    @torch.no_grad()
    def install(self, model: nn.Module) -> int:
        """Wrap every layer some adapter adapts (with spare slots: every adaptable layer) in a
        ``LoraLinear`` holding its stacks (the model's dtype, the layer's device); the stacks' bytes.
        The stacks never move or grow after this: a captured CUDA graph reads them where they are."""
        names = {name for a in self._adapters for name in a.modules}
        if self.spare_rank:
            names |= set(adaptable_layers(model))
        size = 0
        for name in sorted(names):
            base = model.get_submodule(name)
            sizes = model.shard_sizes(f"{name}.weight", base.weight) or [base.weight.shape[0]]
            ranks = [s[0].shape[0] for a in self._adapters for s in a.modules.get(name, ()) if s is not None]
            rank = max(ranks + [self.spare_rank])
            shape_a = (self.num_slots, len(sizes) * rank, base.weight.shape[1])
            a = torch.zeros(shape_a, dtype=model.dtype, device=base.weight.device)
            b = torch.zeros(self.num_slots, sum(sizes), len(sizes) * rank, dtype=model.dtype, device=base.weight.device)
            parent, _, child = name.rpartition(".")
            layer = LoraLinear(base, a, b, self, sizes)  # an FP8 layer's too: x comes in the model dtype
            setattr(model.get_submodule(parent), child, layer)
            self.layers[name] = layer
            size += a.numel() * a.element_size() + b.numel() * b.element_size()
        for adapter in self._adapters:
            self._write(self.slots[adapter.name], adapter)
        model.lora = self
        self.nbytes = size
        return size

    def add(self, adapter: LoraAdapter) -> int:
        """Put a run-time adapter (checked against the model: ``load_adapter``) in a free slot; its
        slot. AdapterError when no slot is free or it adapts a layer or rank the stacks lack."""
        used = set(self.slots.values())
        free = [slot for slot in range(1, self.num_slots) if slot not in used]
        if not free:
            raise NoFreeSlot(f"LoRA adapter {adapter.name!r}: all {self.num_slots - 1} adapter slots are taken")
        for name, shards in adapter.modules.items():
            layer = self.layers.get(name)
            rank = max(s[0].shape[0] for s in shards if s is not None)
            if layer is None or rank > layer.rank:
                raise AdapterError(f"LoRA adapter {adapter.name!r}: {name} at rank {rank} has no room in the stacks")
        self._write(free[0], adapter)
        self.slots[adapter.name] = free[0]
        return free[0]

    def release(self, name: str) -> None:
        """Forget a retired adapter once no request uses it: its slot is free (``add`` overwrites it)."""
        self.slots.pop(name, None)
        self.retiring.discard(name)

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Slot ``slot`` of every layer: the adapter's shards (A rows k R .., B's block at the
        shard's rows), zeros where it leaves a layer or shard alone (a reused slot's old weights go)."""
        for name, layer in self.layers.items():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
            for k, shard in enumerate(adapter.modules.get(name, ())):
                if shard is None:
                    continue
                a, b = shard
                r, row, size = a.shape[0], sum(layer.sizes[:k]), layer.sizes[k]
                layer.lora_a[slot, k * layer.rank : k * layer.rank + r] = a.to(layer.lora_a.dtype)
                layer.lora_b[slot, row : row + size, k * layer.rank : k * layer.rank + r] = b.to(layer.lora_b.dtype)


def adaptable_layers(model: nn.Module) -> list[str]:
    """The linear layers of the decoder an adapter may target (attention and MLP projections): the
    model's ``Linear`` modules but its head (embeddings are no ``Linear``)."""
    return [name for name, m in model.named_modules() if isinstance(m, Linear) and name.rpartition(".")[2] != "lm_head"]


def load_adapters(specs: list[str], model: nn.Module, max_rank: int, spare: int = 0) -> AdapterSet:
    """--lora_modules' adapters read, checked against ``model`` (its weights loaded) and installed,
    with ``spare`` slots of rank ``max_rank`` for adapters loaded at run time (--max_loras)."""
    adapters = [load_adapter(*parse_spec(spec), model=model, max_rank=max_rank) for spec in specs]
    adapter_set = AdapterSet(adapters, spare, max_rank)
    adapter_set.install(model)
    return adapter_set


def check_adapters(specs: list[str], model_dir: str, tp: int, max_rank: int, spare: int = 0) -> None:
    """--lora_modules against the model before anything loads: the model built on the meta device
    (shapes, no memory), each adapter read and checked; AdapterError names the first problem.
    ``spare`` (--max_loras) needs what adapters need: a real model on one rank."""
    if not specs and not spare:
        return
    source = resolve(model_dir)
    if source.kind == "counting":
        raise AdapterError("--lora_modules and --max_loras need a real model, not the counting stand-in")
    if tp > 1:
        raise AdapterError("--lora_modules and --max_loras with --tp above 1 are not supported yet")
    config = load_config(source)
    model = model_class(config)(config, dtype=torch.float32, device="meta")
    for spec in specs:
        load_adapter(*parse_spec(spec), model=model, max_rank=max_rank)
