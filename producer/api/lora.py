"""The LoRA adapters of this producer's model: --lora_modules' (its flags) and the run-time
registry's (``shared.lora.LoraRegistry`` in Redis, changed by ``producer.api.routes_lora``).

A request naming an adapter costs one GET of the registry, and only when the name is not one of
--lora_modules (a request for the base model costs nothing): every producer then answers from the
same record, one started later too, and an adapter unloaded through any producer is a 404 on all
of them at once.
"""

from __future__ import annotations

from producer.api.errors import ApiError
from producer.deps import Services
from shared.codec import decode, encode
from shared.lora import LoraRegistry
from shared.worker_load import WorkerLoad

# Compare-and-set of the registry: written only if it still holds what the producer read (ARGV[1],
# '' for no key), so two producers changing it at once never lose one's change; the loser reads
# again. An empty registry is deleted (nothing left in Redis once every adapter is unloaded).
SWAP_LUA = """
local now = redis.call('GET', KEYS[1]) or ''
if now ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[2]) end
return 1
"""


async def read_registry(services: Services) -> tuple[LoraRegistry, str]:
    """The run-time adapters of this producer's model, and the raw value ('' for none)."""
    raw = await services.redis.get(services.keys.lora_registry(services.model_id))
    if raw is None:
        return LoraRegistry(), ""
    text = raw.decode() if isinstance(raw, bytes) else raw
    return decode(LoraRegistry, text), text


async def swap_registry(services: Services, seen: str, registry: LoraRegistry) -> bool:
    """Write ``registry`` if the key still holds ``seen``; whether it was written."""
    new = encode(registry) if registry.adapters else ""
    script = services.redis.register_script(SWAP_LUA)
    return bool(await script(keys=[services.keys.lora_registry(services.model_id)], args=[seen, new]))


async def adapter_names(services: Services) -> list[str]:
    """Every adapter of the model: --lora_modules' in their order, then the run-time ones by name."""
    registry, _ = await read_registry(services)
    static = services.settings.model.adapter_names
    return static + sorted(name for name in registry.adapters if name not in static)


async def run_time_folder(name: str, services: Services) -> str | None:
    """The folder of run-time adapter ``name`` (None: the registry has no such adapter). A request
    for it carries the folder (``GenerateRequest.adapter_path``): unloaded while it runs, it still
    finishes with it wherever it has to move."""
    registry, _ = await read_registry(services)
    return registry.adapters.get(name)


async def find_adapter(name: str | None, services: Services, param: str) -> tuple[str | None, str | None]:
    """``name`` when the model has such an adapter (None: the base model), with its run-time folder
    (None: a --lora_modules one); else a 404 ``model_not_found`` before anything is queued. The
    router then sends the request only to a worker whose load record lists the adapter."""
    if name is None or name in services.settings.model.adapter_names:
        return name, None
    folder = await run_time_folder(name, services)
    if folder is not None:
        return name, folder
    names = await adapter_names(services)
    raise ApiError(
        404,
        f"The LoRA adapter '{name}' does not exist; this server's adapters: {', '.join(names) or 'none'}",
        param=param,
        code="model_not_found",
        reason="unknown_model",
    )


async def model_loads(services: Services) -> list[WorkerLoad]:
    """The load records of the live workers of this producer's model that are not draining."""
    redis, keys = services.redis, services.keys
    members = await redis.zrange(keys.workers(), 0, -1)
    records = (
        await redis.mget([keys.load(m.decode() if isinstance(m, bytes) else m) for m in members]) if members else []
    )
    loads = [decode(WorkerLoad, raw) for raw in records if raw is not None]
    return [load for load in loads if load.takes(services.model_id)]
