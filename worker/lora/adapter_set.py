"""``AdapterSet``: every adapter a worker serves, stacked per layer, and the batch they run on.

Slots (the index a request's adapter has in every stack):

| slot    | what                          | A and B rows                    |
|---------|-------------------------------|---------------------------------|
| 0       | no adapter (the base model)   | zeros: its delta is 0           |
| 1 .. N  | --lora_modules, in their order | the adapter's, zero-padded to R |

Per adapted layer with n shards (qkv: 3, gate_up: 2, others 1) and R the largest rank any
adapter has on it, A is [S, n R, in] and B [S, out, n R]: shard k's A rows are k R .. k R + r,
and its B block sits at the shard's output rows and the same R columns, zero elsewhere (block
diagonal). One shrink and one expand then serve a fused layer, at the cost of multiplying the
zero blocks (n times the expand's work); a per-shard expand would save that (SGLang's).

Every adapter is on the device from start to end: no paging, no eviction (not in this slice).
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
from worker.model.models import model_class


class AdapterSet:
    def __init__(self, adapters: list[LoraAdapter]):
        self.names = [a.name for a in adapters]
        self.slots = {a.name: i + 1 for i, a in enumerate(adapters)}
        self.max_rank = max((a.rank for a in adapters), default=0)
        self.bound: ForwardBatch | None = None  # set by ``bind`` for one forward
        self.nbytes = 0  # the stacks' device memory, once installed
        self._adapters = adapters

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (None: 0, the base model); KeyError when not served here."""
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
        """Wrap every layer some adapter adapts in a ``LoraLinear`` holding its stacks (the model's
        dtype, the layer's device); the stacks' bytes. The model then binds this set in its forward."""
        names = sorted({name for a in self._adapters for name in a.modules})
        size = 0
        for name in names:
            base = model.get_submodule(name)
            sizes = model.shard_sizes(f"{name}.weight", base.weight) or [base.weight.shape[0]]
            a, b = self._stack(name, sizes, base.weight.shape[1], base.weight.device)
            a, b = a.to(model.dtype), b.to(model.dtype)  # an FP8 layer's too: x comes in the model dtype
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, LoraLinear(base, a, b, self))
            size += a.numel() * a.element_size() + b.numel() * b.element_size()
        model.lora = self
        self.nbytes = size
        return size

    def _stack(self, name: str, sizes: list[int], in_features: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A [S, n R, in] and B [S, out, n R] of layer ``name`` (the table above), fp32."""
        rank = max(s[0].shape[0] for a in self._adapters for s in a.modules.get(name, ()) if s is not None)
        n, num_slots = len(sizes), len(self._adapters) + 1
        a_stack = torch.zeros(num_slots, n * rank, in_features, device=device)
        b_stack = torch.zeros(num_slots, sum(sizes), n * rank, device=device)
        for slot, adapter in enumerate(self._adapters, start=1):
            for k, shard in enumerate(adapter.modules.get(name, [None] * n)):
                if shard is None:
                    continue
                a, b = shard
                r, row = a.shape[0], sum(sizes[:k])
                a_stack[slot, k * rank : k * rank + r] = a
                b_stack[slot, row : row + sizes[k], k * rank : k * rank + r] = b
        return a_stack, b_stack


def load_adapters(specs: list[str], model: nn.Module, max_rank: int) -> AdapterSet:
    """--lora_modules' adapters read, checked against ``model`` (its weights loaded) and installed."""
    adapters = [load_adapter(*parse_spec(spec), model=model, max_rank=max_rank) for spec in specs]
    adapter_set = AdapterSet(adapters)
    adapter_set.install(model)
    return adapter_set


def check_adapters(specs: list[str], model_dir: str, tp: int, max_rank: int) -> None:
    """--lora_modules against the model before anything loads: the model built on the meta device
    (shapes, no memory), each adapter read and checked; AdapterError names the first problem."""
    if not specs:
        return
    source = resolve(model_dir)
    if source.kind == "counting":
        raise AdapterError("--lora_modules needs a real model, not the counting stand-in")
    if tp > 1:
        raise AdapterError("--lora_modules with --tp above 1 is not supported yet")
    config = load_config(source)
    model = model_class(config)(config, dtype=torch.float32, device="meta")
    for spec in specs:
        load_adapter(*parse_spec(spec), model=model, max_rank=max_rank)
