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

--lora_modules' adapters fill slots 1..N at start, for good. With --max_loras M, M more slots
are a device cache of the adapters loaded at run time (``register``, from ``worker.lora.runtime``),
each stack then at least --max_lora_rank wide on every adaptable layer, allocated once before the
KV pool is sized (so admission never counts on that memory): the stacks never move, so captured
CUDA graphs stay valid. Any number of run-time adapters are kept in host memory (the model's dtype,
pinned on a GPU); one is copied into a slot when a request about to start needs it
(``make_resident``, from the runner's ``prepare``), evicting the least recently used one that no
started request uses, and the request waits in its place while every slot is in use. An unloaded
adapter stays (``retiring``) until no request names it, then ``release`` forgets it.
The forward binds its batch (``bind``) so each ``LoraLinear`` reads the batch's slots; binding
is scoped and never nested.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from shared.model_files import load_config, resolve
from worker.lora.adapter import AdapterError, LoraAdapter, load_adapter, parse_spec
from worker.lora.delta import forward_groups
from worker.lora.linear import LoraLinear
from worker.model.forward_batch import ForwardBatch
from worker.model.layers import Linear
from worker.model.models import model_class

if TYPE_CHECKING:
    from worker.lora.page_tables import PageTables
    from worker.lora.staging import Staging
    from worker.model.kernels.bgmv_grouped import TokenGroups


class AdapterSet:
    """``adapters`` in slots 1..N; ``spare`` more slots, a cache of the adapters loaded at run time
    (``register``), each as large as ``rank`` on every adaptable layer (the module's docstring)."""

    def __init__(
        self, adapters: list[LoraAdapter], spare: int = 0, rank: int = 0, page_batch: int = 1, prefetch: int = 0
    ):
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}  # on the device: name -> slot
        self.host: dict[str, LoraAdapter] = {}  # run-time adapters (host memory), on the device or not
        self.recent: OrderedDict[str, None] = OrderedDict()  # run-time ones on the device, least recent first
        self.retiring: set[str] = set()  # unloaded, kept while requests still name them
        self.changes = 0  # grows when what is on the device changes (the load record follows)
        self.loads = 0  # run-time adapters copied into a device slot (/metrics: worker_lora_loads_total)
        self.num_slots = len(adapters) + spare + 1
        self.spare = spare
        # Once every run-time slot was pinned, page in again only when this many are free (AdapterPins).
        self.page_batch = max(1, min(page_batch, spare))
        # Staging buffers for adapters copied ahead of their page-ins (install; 0: page_batch of them).
        self.prefetch_buffers = prefetch or self.page_batch
        self.spare_rank = rank if spare else 0
        self.max_rank = max([a.rank for a in adapters] + [self.spare_rank])
        self.bound: ForwardBatch | None = None  # set by ``bind`` for one forward
        self.groups: TokenGroups | None = None  # the bound forward's tokens by slot (``forward_groups``)
        self.nbytes = 0  # the stacks' device memory, once installed
        self.staging: Staging | None = None  # where page-ins copy an adapter's host buffer to (install)
        self.tables: PageTables | None = None  # the page-ins' job tables, with ``staging``
        self.layers: dict[str, LoraLinear] = {}  # adapted layer name -> its wrapper (``install``)
        self._written: dict[int, dict[str, list[int]]] = {}  # slot -> layer -> each shard's rank written there
        self._adapters = adapters

    @property
    def names(self) -> list[str]:
        """The adapters new requests may name: --lora_modules', then the run-time ones (not retiring)."""
        static = [name for name in self.slots if name not in self.host]
        return static + [name for name in self.host if name not in self.retiring]

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: 0, the base model); KeyError when not on the device
        (a request's adapter is made resident before it starts and stays so until it ends)."""
        if name is None:
            return 0
        if name not in self.slots:
            raise KeyError(f"LoRA adapter {name!r} is not served by this worker (it serves {self.names})")
        return self.slots[name]

    @contextmanager
    def bind(self, batch: ForwardBatch) -> Iterator[None]:
        assert self.bound is None, "an adapter batch is already bound: forwards never nest"
        self.bound = batch
        self.groups = forward_groups(batch, self.num_slots)  # once for every layer (in the graph too)
        try:
            yield
        finally:
            self.bound, self.groups = None, None

    @torch.no_grad()
    def install(self, model: nn.Module, staging: bool | None = None) -> int:
        """Wrap every layer some adapter adapts (with spare slots: every adaptable layer) in a
        ``LoraLinear`` holding its stacks (the model's dtype, the layer's device); the stacks' bytes.
        The stacks never move or grow after this: a captured CUDA graph reads them where they are.
        ``staging`` (default: spare slots on a GPU): buffers as large as the largest adapter the stacks
        take, so page-ins copy an adapter's host buffer in one DMA and one launch, ``prefetch_buffers``
        of them ahead of their slots (``worker.lora.staging``)."""
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
        device = next(iter(self.layers.values())).lora_a.device if self.layers else torch.device("cpu")
        if self.layers and (staging if staging is not None else bool(self.spare) and device.type == "cuda"):
            most = sum(layer.lora_a[0].numel() + sum(layer.sizes) * layer.rank for layer in self.layers.values())
            from worker.lora.page_tables import PageTables  # triton's kernel: only where page-ins stage
            from worker.lora.staging import Staging

            self.staging = Staging(most, model.dtype, device, ahead=self.prefetch_buffers if self.spare else 0)
            self.tables = PageTables(device, limit=4 * self.num_slots)
            size += self.staging.nbytes
        for adapter in self._adapters:
            self._write(self.slots[adapter.name], adapter)
        model.lora = self
        self.nbytes = size
        return size

    def register(self, adapter: LoraAdapter) -> None:
        """Keep a run-time adapter (checked against the model: ``load_adapter``) in host memory,
        copied to the device now if a slot is free, else when a request needs it (``make_resident``).
        AdapterError when it adapts a layer or a rank the stacks lack."""
        for name, shards in adapter.modules.items():
            layer = self.layers.get(name)
            rank = max(s[0].shape[0] for s in shards if s is not None)
            if layer is None or rank > layer.rank:
                raise AdapterError(f"LoRA adapter {adapter.name!r}: {name} at rank {rank} has no room in the stacks")
        self.host[adapter.name] = adapter
        free = self._free_slot()
        if free is not None:
            self._place(adapter.name, free)

    def make_resident(self, name: str, pinned: Collection[str]) -> bool:
        """Adapter ``name`` on the device, paged in if it is not, into a free slot or the least
        recently used one of a run-time adapter no started request uses (``pinned``: those that
        are); False when every slot is pinned (the request waits). True for a name not served here
        (``ModelRunner.start`` refuses it)."""
        if name in self.slots:
            if name in self.recent:
                self.recent.move_to_end(name)
            return True
        if name not in self.host:
            return True
        slot = self._free_slot()
        if slot is None:
            victim = next((n for n in self.recent if n not in pinned), None)
            if victim is None:
                return False
            slot = self.slots.pop(victim)
            del self.recent[victim]
        self._place(name, slot)
        return True

    def prefetch(self, name: str) -> None:
        """Start copying run-time adapter ``name`` towards the device for a page-in to come (a request
        waits for a slot: ``AdapterPins``); nothing where page-ins do not stage or it is resident."""
        adapter = self.host.get(name)
        if self.staging is not None and adapter is not None and adapter.flat is not None and name not in self.slots:
            self.staging.prefetch(name, adapter.flat)

    def release(self, name: str) -> None:
        """Forget a retired adapter once no request names it: its slot (if it has one) is free."""
        if self.staging is not None:
            self.staging.forget(name)
        self.host.pop(name, None)
        self.slots.pop(name, None)
        self.recent.pop(name, None)
        self.retiring.discard(name)
        self.changes += 1

    def _free_slot(self) -> int | None:
        used = set(self.slots.values())
        return next((slot for slot in range(1, self.num_slots) if slot not in used), None)

    def _place(self, name: str, slot: int) -> None:
        self._write(slot, self.host[name])
        self.slots[name] = slot
        self.recent[name] = None
        self.changes += 1
        self.loads += 1

    @torch.no_grad()
    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        """Slot ``slot`` of every layer: the adapter's shards (``_pieces``); in one launch from the
        adapter's host buffer over a job table kept on the device (``worker.lora.page_tables``) where
        the stacks have a staging buffer (``scatter_copy``), else piece by piece (a CPU: the reference)."""
        if self.staging is not None and adapter.flat is not None and self.tables is not None:
            page = self.tables.get(
                slot, adapter.layout, adapter.flat, lambda: (self._pieces(slot, adapter), self._written[slot])
            )
            # what ``_pieces`` would leave there (a copy: ``_pieces`` sets its layers' entries in place)
            self._written[slot] = dict(page.written)
            self.staging.write(adapter.name, page.table, adapter.flat)
            return
        # pinned host memory on a GPU (load_adapter): asynchronous, ordered on the stream
        for dst, src in self._pieces(slot, adapter):
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src, non_blocking=True)

    def _pieces(self, slot: int, adapter: LoraAdapter) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(slice of a stack, what goes there: a host tensor, or None for zeros) for every shard: A
        rows k R .., B's block at the shard's rows; zeros only where the slot's previous adapter
        wrote and this one does not (a reused slot's old weights go; the off-diagonal blocks of B
        are never written, so stay zero). Zeroing every slice of a 32-layer model was 256 launches
        a page-in, more than half its copies."""
        written = self._written.setdefault(slot, {})
        pieces: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for name, layer in self.layers.items():
            shards = list(adapter.modules.get(name, ()))
            shards += [None] * (len(layer.sizes) - len(shards))
            ranks = [0 if shard is None else shard[0].shape[0] for shard in shards]
            for k, (shard, old) in enumerate(zip(shards, written.get(name, [0] * len(ranks)))):
                row, size, first, new = sum(layer.sizes[:k]), layer.sizes[k], k * layer.rank, ranks[k]
                if old > new:  # the previous adapter's ranks past this one's
                    pieces.append((layer.lora_a[slot, first + new : first + old], None))
                    pieces.append((layer.lora_b[slot, row : row + size, first + new : first + old], None))
                if shard is not None:
                    pieces.append((layer.lora_a[slot, first : first + new], shard[0]))
                    pieces.append((layer.lora_b[slot, row : row + size, first : first + new], shard[1]))
            written[name] = ranks
        return pieces


def adaptable_layers(model: nn.Module) -> list[str]:
    """The linear layers of the decoder an adapter may target (attention and MLP projections): the
    model's ``Linear`` modules but its head (embeddings are no ``Linear``)."""
    return [name for name, m in model.named_modules() if isinstance(m, Linear) and name.rpartition(".")[2] != "lm_head"]


def load_adapters(
    specs: list[str], model: nn.Module, max_rank: int, spare: int = 0, page_batch: int = 1, prefetch: int = 0
) -> AdapterSet:
    """--lora_modules' adapters read, checked against ``model`` (its weights loaded) and installed,
    with ``spare`` slots of rank ``max_rank`` for adapters loaded at run time (--max_loras), paged
    in ``page_batch`` at a time once they were all pinned (--lora_page_batch), ``prefetch`` of the
    waiting ones copied ahead on a GPU (--lora_prefetch; 0: ``page_batch``)."""
    adapters = [load_adapter(*parse_spec(spec), model=model, max_rank=max_rank) for spec in specs]
    adapter_set = AdapterSet(adapters, spare, max_rank, page_batch, prefetch)
    adapter_set.install(model)
    return adapter_set


def check_adapters(specs: list[str], model_dir: str, tp: int, max_rank: int, spare: int = 0, cache: str = "") -> None:
    """--lora_modules against the model before anything loads: the model built on the meta device
    (shapes, no memory), each adapter read and checked; AdapterError names the first problem.
    ``spare`` (--max_loras) needs what adapters need: a real model on one rank. ``cache``: the
    --weights_cache folder, where a GGUF's config is kept (``shared.gguf_meta``)."""
    if not specs and not spare:
        return
    source = resolve(model_dir)
    if source.kind == "counting":
        raise AdapterError("--lora_modules and --max_loras need a real model, not the counting stand-in")
    if tp > 1:
        raise AdapterError("--lora_modules and --max_loras with --tp above 1 are not supported yet")
    config = load_config(source, cache)
    model = model_class(config)(config, dtype=torch.float32, device="meta")
    for spec in specs:
        load_adapter(*parse_spec(spec), model=model, max_rank=max_rank)
