"""Queued requests whose LoRA adapter is gone: ended at once with ``shared.lora.gone_error`` (the
producer answers 404 ``model_not_found``), not left at the head of the queue until their timeout.

The router sends an adapter's request only to a worker whose load record lists the adapter
(``WorkerLoad.serves``). After ``POST /v1/unload_lora_adapter`` no worker lists it any more, so a
request for it that was queued before the unload would wait for a worker that never comes, and
everything behind it with it. It is gone when, at the moment no worker can take it:

- some live worker of its model is up (with none, workers may be starting: it waits for them), and
- none of them lists the adapter, and
- it does not bring the adapter to a worker that can load it: a request that started before the
  unload and must move carries its folder (``GenerateRequest.brings_adapter``) and waits for a
  worker with run-time slots (``WorkerLoad.adopts``), one that never started does not, and
- the model's run-time registry (``shared.lora.LoraRegistry``, read then) does not list it either,
  or every live worker of the model reported that it could not load it (``WorkerLoad.lora_failed``).

The registry is read fresh each time (no cache): a load writes the registry before any worker
lists the adapter, so a stale read could end a request for an adapter just loaded. The read
happens only while a request's adapter is listed by no live worker, a moment around a load or an
unload. A --lora_modules adapter is in no registry: workers list it from their start, so it is
gone only when no live worker of the model was started with it.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

from shared.codec import decode
from shared.keys import Keys
from shared.lora import LoraRegistry
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad


def adapter_gone(client: redis.Redis, keys: Keys, request: GenerateRequest, loads: Mapping[str, WorkerLoad]) -> bool:
    """Whether ``request``'s adapter is gone (the module's docstring); ``loads``: the live workers."""
    adapter = request.adapter
    if adapter is None:
        return False
    ours = [load for load in loads.values() if load.serves(request.model)]
    if not ours or any(adapter in load.adapters or load.adopts(request) for load in ours):
        return False
    if all(any(name == adapter for name, _, _ in load.lora_failed) for load in ours):
        return True  # recorded, but no worker could load it: nothing will ever serve it
    raw = client.get(keys.lora_registry(request.model))
    if raw is None:
        return True
    registry = decode(LoraRegistry, raw.decode() if isinstance(raw, bytes) else raw)
    return adapter not in registry.adapters
