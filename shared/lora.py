"""LoRA adapters loaded at run time (issue 32): the pool's desired set in Redis, and the checks of
an adapter folder that need no model.

The producer's ``POST /v1/load_lora_adapter`` adds a name and path to ``LoraRegistry`` (one key per
served model, ``Keys.lora_registry``) and ``/v1/unload_lora_adapter`` removes one; every worker of
the model reads the key (``worker.service.intake``) and reconciles its adapters against it
(``worker.lora.runtime``), a worker started later too: the key, not a message, is the record, so
nothing is lost while a worker is away. ``version`` grows with every change, so a worker applies a
set it has not seen and nothing else.

Unloading stops new requests for an adapter, never one under way: a worker keeps it while its
requests run (``worker.lora.runtime``), and a request that started there and must move (its
worker died, drained or paused it) carries the folder it was accepted with
(``GenerateRequest.adapter_path``, the producer's copy of the registry's): a worker with run-time
slots (``AdapterView.adopts``) loads it again for that request alone, never listing it for new
ones, and forgets it when its requests end.

``folder_problem`` is what can be known of a folder without the model (files, PEFT features lightq
does not compute, rank, target names); the worker checks the shapes against its model when it
loads, and ``worker.lora.adapter`` applies the same config checks at start.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# Names travel in JSON, Redis keys' values, OpenAI's ``model`` and log lines: a plain token.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# The checkpoint module names an adapter may target in the families lightq serves: Llama, Mistral
# and Qwen2's projections, Bloom's. Anything else is an embedding, the head, or another model's.
TARGETS = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    | {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
)
# A request whose adapter went (unloaded) before it started ends with an error that starts with this
# code and ": " (the router's ``router.lora.adapter_gone``, a worker's refusal): the producer answers 404
# ``model_not_found``, as it answers a request naming an unknown adapter.
GONE = "model_not_found"


def gone_error(name: str, started: bool = False) -> str:
    """The error a request for adapter ``name`` ends with when no worker serves the adapter: it went
    before the request started, or (``started``: it had sent tokens) it was unloaded while the request
    ran, the request then had to move (its worker stopped) and no worker could load it again from the
    request's folder (``GenerateRequest.brings_adapter``: none with run-time slots, the folder gone,
    or a message from before folders travelled)."""
    if started:
        return (
            f"{GONE}: The LoRA adapter '{name}' was unloaded while this request ran, and the request had to "
            "move to another worker (its own stopped), where the adapter could not be loaded again"
        )
    return f"{GONE}: The LoRA adapter '{name}' is not served: unloaded before the request started, or never loaded"


def is_gone(error: str | None) -> bool:
    """Whether a request's ``error`` says its adapter went (``gone_error``)."""
    return (error or "").startswith(f"{GONE}: ")


# PEFT features this slice does not compute: refused, never silently dropped.
REFUSED = {
    "use_dora": "DoRA",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
}


@dataclass(frozen=True)
class AdapterView:
    """What the load record says of a worker's adapters, replaced whole after each change: the
    heartbeat thread reads it while the loop reconciles."""

    serving: tuple[str, ...] = ()  # new requests may name these
    resident: tuple[str, ...] = ()  # in a device slot (retiring ones too)
    failed: tuple[tuple[str, str, str], ...] = ()  # (name, folder, why it did not load)
    adopts: bool = False  # it has run-time slots: it loads a moved request's unloaded adapter for it


class LoraRegistry(BaseModel):
    """The adapters loaded at run time for one served model (--lora_modules' are not in it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    version: int = Field(0, ge=0, description="grows with every load and unload")
    adapters: dict[str, str] = Field(default_factory=dict, description="adapter name -> its PEFT folder")

    def with_adapter(self, name: str, path: str | None) -> LoraRegistry:
        """The next version, with ``name`` at ``path`` (None: without it)."""
        adapters = {n: p for n, p in self.adapters.items() if n != name}
        if path is not None:
            adapters[name] = path
        return LoraRegistry(version=self.version + 1, adapters=adapters)


def config_problem(config: dict[str, Any], max_rank: int | None = None) -> str | None:
    """What in an ``adapter_config.json`` lightq cannot run exactly as PEFT runs it (None: nothing);
    ``max_rank``: its ``r`` checked too (a worker checks each module's rank in the weights instead)."""
    if config.get("peft_type", "LORA") != "LORA":
        return f"peft_type {config.get('peft_type')!r}, not LORA"
    for key, what in REFUSED.items():
        if config.get(key):
            return f"{what} is not supported"
    if config.get("bias", "none") != "none":
        return f"bias {config['bias']!r} is not supported (only 'none')"
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        return f"{CONFIG_FILE} has no rank 'r'"
    if max_rank is not None and rank > max_rank:
        return f"rank {rank} is over --max_lora_rank {max_rank}"
    alpha = config.get("lora_alpha", rank)  # PEFT's scaling is lora_alpha / r (or / sqrt(r))
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        return f"lora_alpha {alpha!r} is not a finite number"
    if not isinstance(config.get("use_rslora", False), bool):
        return f"use_rslora {config['use_rslora']!r} is not true or false"
    return None


def folder_problem(path: str, max_rank: int) -> str | None:
    """Why the folder at ``path`` cannot be an adapter of any model lightq serves (None: it may be;
    the worker checks the shapes). Reads only the small config file."""
    if not os.path.isdir(path):
        return f"{path} is not a folder"
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        return f"{path} has no {WEIGHTS_FILE}"
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        return f"cannot read {CONFIG_FILE}: {exc}"
    if not isinstance(config, dict):
        return f"{CONFIG_FILE} is not a JSON object"
    problem = config_problem(config, max_rank)
    if problem is not None:
        return problem
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a string is a regex PEFT matched when it saved: the worker checks
        unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - TARGETS)
        if unknown:
            return f"target modules {unknown} are not supported (only {sorted(TARGETS)})"
    return None
