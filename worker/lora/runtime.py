"""A worker's adapters loaded and unloaded at run time: its side of ``shared.lora.LoraRegistry``.

The intake hands the model loop the registry whenever it changed (``worker.service.intake``); the
loop calls ``update`` and then ``reconcile`` between two steps, so no forward ever sees a slot
change under it. ``reconcile`` is idempotent and runs again while anything is pending:

- an adapter the registry gains is read from its folder, checked against the model and copied
  into a free slot (``AdapterSet.add``); reading it happens on the loop (tens of milliseconds for a
  rank-16 adapter of an 8B model: a pause of one step, taken once per load);
- one it loses (or whose path changed) retires: new requests for it are refused at once (the load
  record stops listing it, so routers stop sending it), requests already here run to their end
  with it, and its slot is freed when none is left; a path changed meanwhile loads after that;
- one that cannot load (shapes that do not fit the model, no free slot, unreadable files) is
  remembered with its error, published in the load record (``WorkerLoad.lora_failed``) and not
  tried again until its path changes (one refused for want of a free slot: until a slot frees);
  the worker serves on.

--lora_modules' adapters are not the registry's: the producer refuses to load or unload them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from torch import nn

from shared.lora import AdapterView, LoraRegistry
from worker.lora.adapter import AdapterError, load_adapter
from worker.lora.adapter_set import AdapterSet, NoFreeSlot

log = logging.getLogger("lightq.worker")

NO_SLOTS = "this worker has no slots for adapters loaded at run time (started with --max_loras 0)"


class AdapterRuntime:
    def __init__(self, adapters: AdapterSet | None, model: nn.Module, max_rank: int, static: Collection[str]):
        self.adapters = adapters  # None: the model has no adapter stacks (no --lora_modules, --max_loras 0)
        self.model = model
        self.max_rank = max_rank
        self.static = frozenset(static)
        self.desired: dict[str, str] = {}  # the registry's adapters: name -> folder
        self.loaded: dict[str, str] = {}  # run-time adapters in a slot here (retiring ones too) -> folder
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (folder, why it did not load)
        self.no_slot: set[str] = set()  # of those, the ones that found every slot taken
        self.dirty = False  # the registry changed since the last reconcile
        self.view = self._view()

    def _view(self) -> AdapterView:
        if self.adapters is None:
            return AdapterView(failed=tuple(self.failures()))
        return AdapterView(tuple(self.adapters.names), tuple(self.adapters.slots), tuple(self.failures()))

    @property
    def pending(self) -> bool:
        """Whether ``reconcile`` has work: a new registry, or a retired adapter still in its slot."""
        return self.dirty or (self.adapters is not None and bool(self.adapters.retiring))

    def failures(self) -> list[tuple[str, str, str]]:
        return sorted((name, path, error) for name, (path, error) in self.failed.items())

    def update(self, registry: LoraRegistry) -> None:
        self.desired = {name: path for name, path in registry.adapters.items() if name not in self.static}
        self.dirty = True

    def reconcile(self, in_use: Collection[str]) -> bool:
        """Bring the slots toward the registry; ``in_use``: the adapters of the requests the engine
        holds. Whether what the load record shows changed (``view``)."""
        before = self.view
        self.dirty = False
        self.failed = {n: f for n, f in self.failed.items() if self.desired.get(n) == f[0]}
        self.no_slot &= set(self.failed)
        if self.adapters is not None:
            self._retire(in_use)
        for name, path in sorted(self.desired.items()):
            if name not in self.loaded and name not in self.failed:
                self._load(name, path)
        self.view = self._view()
        return self.view != before

    def _retire(self, in_use: Collection[str]) -> None:
        assert self.adapters is not None
        for name, path in list(self.loaded.items()):
            if self.desired.get(name) != path and name not in self.adapters.retiring:
                self.adapters.retiring.add(name)
                log.info("LoRA adapter %r unloaded: no new requests; its slot frees when its requests end", name)
            if name in self.adapters.retiring and name not in in_use:
                self.adapters.release(name)
                del self.loaded[name]
                for waiting in self.no_slot:  # a slot is free: they are tried again below
                    self.failed.pop(waiting, None)
                self.no_slot.clear()

    def _load(self, name: str, path: str) -> None:
        if self.adapters is None:
            self.failed[name] = (path, NO_SLOTS)
            log.warning("LoRA adapter %r (%s) not loaded: %s", name, path, NO_SLOTS)
            return
        try:
            slot = self.adapters.add(load_adapter(name, path, self.model, self.max_rank))
        except (AdapterError, OSError) as exc:
            self.failed[name] = (path, str(exc))
            if isinstance(exc, NoFreeSlot):
                self.no_slot.add(name)
            log.warning("LoRA adapter %r not loaded: %s; the worker serves on", name, exc)
            return
        self.loaded[name] = path
        log.info("LoRA adapter %r loaded at run time from %s (slot %d)", name, path, slot)
