"""A worker's adapters loaded and unloaded at run time: its side of ``shared.lora.LoraRegistry``.

The intake hands the model loop the registry whenever it changed (``worker.service.intake``); the
loop calls ``update`` and then ``reconcile`` between two steps, so no forward ever sees a slot
change under it. ``reconcile`` is idempotent and runs again while anything is pending:

- an adapter the registry gains is read from its folder, checked against the model and kept in
  host memory (``AdapterSet.register``: on the device at once if a slot is free, else paged in
  when a request needs it); reading it happens on the loop (tens of milliseconds for a rank-16
  adapter of an 8B model: a pause of one step, taken once per load);
- one it loses (or whose path changed) retires: new requests for it are refused at once (the load
  record stops listing it, so routers stop sending it), requests already here run to their end
  with it, and it is forgotten when none is left; a path changed meanwhile loads after that;
- one that cannot load (shapes that do not fit the model, unreadable files, a worker without
  slots) is remembered with its error, published in the load record (``WorkerLoad.lora_failed``)
  and not tried again until its path changes; the worker serves on;
- a request that started elsewhere and moved here after its adapter was unloaded brings the
  adapter's folder (``GenerateRequest.brings_adapter``): ``adopt`` loads it from there as a retiring
  adapter, so it serves that request (and any other such one) and never a new one, and goes as
  retiring ones go. A worker without run-time slots adopts nothing (``AdapterView.adopts``).

--lora_modules' adapters are not the registry's: the producer refuses to load or unload them.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from torch import nn

from shared.lora import AdapterView, LoraRegistry
from shared.schemas import GenerateRequest
from worker.lora.adapter import AdapterError, load_adapter
from worker.lora.adapter_set import AdapterSet

log = logging.getLogger("lightq.worker")

NO_SLOTS = "this worker has no slots for adapters loaded at run time (started with --max_loras 0)"


class AdapterRuntime:
    def __init__(self, adapters: AdapterSet | None, model: nn.Module, max_rank: int, static: Collection[str]):
        self.adapters = adapters  # None: the model has no adapter stacks (no --lora_modules, --max_loras 0)
        self.model = model
        self.max_rank = max_rank
        self.static = tuple(static)  # --lora_modules' names, in their order
        self.desired: dict[str, str] = {}  # the registry's adapters: name -> folder
        self.loaded: dict[str, str] = {}  # run-time adapters registered here (retiring ones too) -> folder
        self.failed: dict[str, tuple[str, str]] = {}  # name -> (folder, why it did not load)
        self.dirty = False  # the registry changed since the last reconcile
        self._changes = 0  # the AdapterSet's ``changes`` the view was made at
        self.view = self._view()

    def refresh(self) -> bool:
        """The view again if what is on the device changed since (a step paged an adapter in);
        whether it did."""
        if self.adapters is None or self.adapters.changes == self._changes:
            return False
        before, self.view = self.view, self._view()
        return self.view != before

    def _view(self) -> AdapterView:
        self._changes = self.adapters.changes if self.adapters is not None else 0
        if self.adapters is None:  # a stand-in model (tests): it serves what it was started with
            return AdapterView(self.static, self.static, tuple(self.failures()))
        names, resident = tuple(self.adapters.names), tuple(self.adapters.slots)
        return AdapterView(names, resident, tuple(self.failures()), adopts=self.adapters.spare > 0)

    @property
    def pending(self) -> bool:
        """Whether ``reconcile`` has work: a new registry, or a retired adapter still named by requests."""
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
                log.info("LoRA adapter %r unloaded: no new requests; it goes when its requests end", name)
            if name in self.adapters.retiring and name not in in_use:
                self.adapters.release(name)
                del self.loaded[name]

    def adopt(self, msg: GenerateRequest) -> bool:
        """Whether ``msg``, whose adapter this worker does not serve, may run here all the same: it
        brings the adapter (``GenerateRequest.brings_adapter``: it started before an unload) and the
        adapter is here, retiring, from that folder, or loads from it now, retiring at once. Never
        served to new requests; forgotten when no request names it (``_retire``)."""
        name, path = msg.adapter, msg.adapter_path
        if self.adapters is None or self.adapters.spare == 0 or not msg.brings_adapter:
            return False
        assert name is not None and path is not None
        if name in self.loaded:  # retiring here: the request's own weights only if from its folder
            return self.loaded[name] == path
        error = self._register(name, path)
        if error is not None:
            log.warning("LoRA adapter %r (unloaded) not loaded again for moved request %s: %s", name, msg.id, error)
            return False
        self.adapters.retiring.add(name)
        log.info("LoRA adapter %r (unloaded) loaded again from %s for moved request %s", name, path, msg.id)
        return True

    def _load(self, name: str, path: str) -> None:
        if self.adapters is None:
            self.failed[name] = (path, NO_SLOTS)
            log.warning("LoRA adapter %r (%s) not loaded: %s", name, path, NO_SLOTS)
            return
        error = self._register(name, path)
        if error is not None:
            self.failed[name] = (path, error)
            log.warning("LoRA adapter %r not loaded: %s; the worker serves on", name, error)
            return
        log.info("LoRA adapter %r loaded at run time from %s", name, path)

    def _register(self, name: str, path: str) -> str | None:
        """Read the adapter at ``path``, check it against the model and keep it (``loaded``); why it
        could not be (None: it is)."""
        assert self.adapters is not None
        try:
            self.adapters.register(load_adapter(name, path, self.model, self.max_rank))
        except (AdapterError, OSError) as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001
            # Any other error is a check load_adapter lacks (a file it misreads). The registry is
            # durable: were it to escape, every worker that reads the registry would die at start
            # again, the whole pool, until someone unloads the adapter. Reported like any other.
            log.exception("LoRA adapter %r not loaded (an unexpected error); the worker serves on", name)
            return f"{type(exc).__name__}: {exc}"
        self.loaded[name] = path
        return None
