"""Loading and unloading LoRA adapters at run time: vLLM's ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, behind the API keys as every route is.

Everything that can be checked without the model is checked first, and a 4xx writes nothing:
the name (``shared.lora.NAME``, not the model's own, not one of --lora_modules, not loaded
already), the folder (``shared.lora.folder_problem``: files, PEFT features, rank over
--max_lora_rank, target modules). Then the producer records the change in the model's registry
(``Keys.lora_registry``, a compare-and-set) and the workers reconcile against it
(``worker.lora.runtime``), those started later too.

When it answers: a load waits up to --lora_wait_s for a live worker of the model to list the
adapter in its load record (200: requests for it are routed from then on). If every live worker
reported that it could not load it (shapes that do not fit the model, no free slot), the change
is taken back and the answer is 422 with a worker's reason. Otherwise (no live worker yet, or
still loading) 202: the adapter is recorded and workers load it when they can. An unload waits
the same way until no live worker lists it (200), else 202. Requests already running with an
unloaded adapter run to their end; new ones for it are 404 ``model_not_found`` at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from producer.api.errors import ApiError, bad_request
from producer.api.lora import model_loads, read_registry, swap_registry
from producer.deps import Services, ServicesDep, parse_body
from shared.lora import NAME, folder_problem
from shared.worker_load import WorkerLoad

router = APIRouter(prefix="/v1")
POLL_S = 0.05  # how often the load records are read while a load or an unload waits for workers
ERRORS = {
    400: {"description": "a bad name or folder; nothing was written"},
    404: {"description": "unload: no such run-time adapter"},
    422: {"description": "load: every live worker failed to load it (the change was taken back)"},
}


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(description="the name requests choose it by (OpenAI's 'model')")
    lora_path: str = Field(description="a PEFT folder every worker can read: adapter_config.json + weights")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


class LoraChange(BaseModel):
    lora_name: str
    status: Literal["loaded", "unloaded", "recorded"] = Field(
        description="loaded / unloaded: live workers did it (200); recorded: workers will (202)"
    )
    workers: list[str] = Field(description="load: the live workers serving it; unload: those still listing it")


@router.post("/load_lora_adapter", responses=ERRORS)
async def load_lora_adapter(request: Request, services: ServicesDep) -> JSONResponse:
    body = await parse_body(request, LoadLoraAdapter)
    name, path = body.lora_name, body.lora_path
    _check_name(name, services)
    problem = folder_problem(path, services.settings.model.max_lora_rank)
    if problem is not None:
        raise bad_request(f"LoRA adapter '{name}': {problem}", param="lora_path", code="invalid_lora_adapter")
    if not await _change(services, name, path):
        raise bad_request(f"The LoRA adapter '{name}' has already been loaded", param="lora_name", code="lora_exists")
    serving, failed = await _wait(services, lambda load: name in load.adapters, (name, path))
    if failed is not None:
        await _change(services, name, None, expect=path)  # taken back: no worker can serve it
        message = f"No live worker could load the LoRA adapter '{name}': {failed}"
        raise ApiError(422, message, param="lora_path", code="invalid_lora_adapter")
    return _answer(name, "loaded" if serving else "recorded", serving)


@router.post("/unload_lora_adapter", responses=ERRORS)
async def unload_lora_adapter(request: Request, services: ServicesDep) -> JSONResponse:
    name = (await parse_body(request, UnloadLoraAdapter)).lora_name
    if name in services.settings.model.adapter_names:
        raise bad_request(f"The LoRA adapter '{name}' was given at start (--lora_modules)", param="lora_name")
    if not await _change(services, name, None):
        raise ApiError(404, f"The LoRA adapter '{name}' cannot be found", param="lora_name", code="model_not_found")
    listing, _ = await _wait(services, lambda load: name in load.adapters, None, until_none=True)
    return _answer(name, "recorded" if listing else "unloaded", listing)


def _check_name(name: str, services: Services) -> None:
    if not NAME.fullmatch(name):
        raise bad_request(
            f"lora_name {name!r}: 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="lora_name",
        )
    taken = {services.model_id, services.settings.model.model_dir, *services.settings.model.adapter_names}
    if name in taken:
        raise bad_request(f"lora_name '{name}' is the model's or a --lora_modules adapter's", param="lora_name")


async def _change(services: Services, name: str, path: str | None, expect: str | None = None) -> bool:
    """Add ``name`` at ``path`` (None: remove it); False when it is there already (adding) or
    absent (removing; with ``expect``: at another folder). Retried until the compare-and-set holds."""
    while True:
        registry, seen = await read_registry(services)
        current = registry.adapters.get(name)
        if (path is not None and current is not None) or (path is None and current is None):
            return False
        if expect is not None and current != expect:
            return False
        if await swap_registry(services, seen, registry.with_adapter(name, path)):
            return True


async def _wait(
    services: Services, lists: Callable[[WorkerLoad], bool], loading: tuple[str, str] | None, until_none: bool = False
) -> tuple[list[str], str | None]:
    """Poll the model's live workers for up to --lora_wait_s: (those for which ``lists(load)``, a
    reason when every live worker failed to load ``loading``, a name and folder). Done when some
    worker lists it (or, with ``until_none``, when none does) or all failed."""
    deadline = time.monotonic() + services.settings.lora_wait_s
    while True:
        loads = await model_loads(services)
        listing = sorted(load.worker_id for load in loads if lists(load))
        errors = [_failure(load, loading) for load in loads] if loading is not None else []
        if loads and errors and all(errors):
            return listing, errors[0]
        if bool(listing) != until_none or time.monotonic() >= deadline:
            return listing, None
        await asyncio.sleep(POLL_S)


def _failure(load: WorkerLoad, loading: tuple[str, str]) -> str | None:
    """Why the worker could not load this name from this folder (None: it did not say it could not)."""
    return next((error for name, path, error in load.lora_failed if (name, path) == loading), None)


def _answer(name: str, status: str, workers: list[str]) -> JSONResponse:
    body = LoraChange(lora_name=name, status=status, workers=workers)  # type: ignore[arg-type]
    return JSONResponse(body.model_dump(), status_code=202 if status == "recorded" else 200)
