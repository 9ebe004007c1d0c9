"""One LoRA adapter in PEFT's format, read and checked against the model it will run on.

A PEFT folder holds ``adapter_config.json`` (rank ``r``, ``lora_alpha``, which modules) and
``adapter_model.safetensors``, whose tensors are named after the transformers module they adapt:
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]. The layer
computes ``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``); the scaling is folded into B here, so the compute never sees it.

lightq fuses q/k/v and gate/up into one matmul each (``worker.model.models.llama``): a module's
checkpoint name is mapped to its fused parameter and row range (shard) through the model's own
``checkpoint_target`` / ``shard_sizes``, the map its weights loaded through, so every family
lightq serves takes adapters the same way. Anything PEFT can express that this slice does not
compute (DoRA, LoRA biases, embedding adapters, per-module alphas) is refused at start, never
silently dropped: an adapter either runs exactly as PEFT runs it or not at all.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

from shared.lora import CONFIG_FILE, WEIGHTS_FILE, config_problem
from worker.model.layers import Linear

# base_model.model.<module>.lora_A.weight; PEFT drops the adapter's own name when it saves
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that does not fit the model: its message names the adapter and the problem."""


Shard = tuple[torch.Tensor, torch.Tensor]  # A [r, in], B [rows of the shard, r] (scaling folded in)


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the largest rank among its modules
    # lightq module name (e.g. model.layers.0.self_attn.qkv_proj) -> per shard of its rows, the
    # shard's (A, B) or None where the adapter leaves that shard alone (k of qkv, say)
    modules: dict[str, list[Shard | None]]
    # the one host buffer every tensor above views (``pack``), so a page-in copies it in one DMA
    # (``worker.model.kernels.scatter_copy``); None for adapters built otherwise (tests)
    flat: torch.Tensor | None = None
    # the buffer's layout: (module, per shard (A shape, B shape) or None), in ``pack``'s order; equal
    # layouts lay their tensors out at equal offsets (``worker.lora.page_tables`` keys on it)
    layout: tuple = ()


def parse_spec(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (name, path); shared.config checked the form already."""
    name, path = spec.split("=", 1)
    return name, path


def load_adapter(name: str, path: str, model: nn.Module, max_rank: int) -> LoraAdapter:
    """The adapter at ``path`` in host memory, checked against ``model``; AdapterError when it cannot
    run exactly as PEFT would run it. Its tensors are in the model's dtype, the scaling folded into B
    in fp32 first: what ``AdapterSet`` would round them to when it copies them into a slot, so the
    same values, at half the host memory of fp32 for a bf16 model; pinned when the model is on a
    GPU, so paging one into a slot is a DMA on the model's stream, not a copy the host waits for."""

    def fail(problem: str) -> AdapterError:
        return AdapterError(f"LoRA adapter {name!r} ({path}): {problem}")

    config = _read_config(path, fail)
    alpha = float(config.get("lora_alpha", config["r"]))
    pairs = _read_pairs(path, fail)
    # A layer adapters wrap already (a run-time load: ``LoraLinear``) keeps its Linear as ``.base``.
    linears = {n.removesuffix(".base"): m for n, m in model.named_modules() if isinstance(m, Linear)}
    modules: dict[str, list[Shard | None]] = {}
    for module, (a, b) in sorted(pairs.items()):
        rank = a.shape[0]
        if rank == 0:
            raise fail(f"{module} has rank 0")
        if rank > max_rank:
            raise fail(f"rank {rank} of {module} is over --max_lora_rank {max_rank}")
        if b.shape[1] != rank:
            raise fail(f"{module}: lora_A has rank {rank}, lora_B {b.shape[1]}")
        target, shard = model.checkpoint_target(f"{module}.weight")
        ours = target.removesuffix(".weight")
        if ours not in linears:
            raise fail(f"targets {module}, which is no linear layer of {type(model).__name__}")
        weight = linears[ours].weight
        sizes = model.shard_sizes(target, weight) or [weight.shape[0]]
        if a.shape[1] != weight.shape[1] or b.shape[0] != sizes[shard]:
            layer = f"[{sizes[shard]}, {weight.shape[1]}]"
            raise fail(f"{module}: A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a {layer} layer")
        scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        shards = modules.setdefault(ours, [None] * len(sizes))
        shards[shard] = (a.float().to(model.dtype), (b.float() * scaling).to(model.dtype))
    if not modules:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    rank = max(s[0].shape[0] for shards in modules.values() for s in shards if s is not None)
    flat, modules = pack(modules, pin=next(iter(linears.values())).weight.is_cuda)
    return LoraAdapter(name, rank, modules, flat, layout_of(modules))


def layout_of(modules: dict[str, list[Shard | None]]) -> tuple:
    """``LoraAdapter.layout`` of ``pack``'s modules."""
    return tuple(
        (name, tuple(None if s is None else (tuple(s[0].shape), tuple(s[1].shape)) for s in shards))
        for name, shards in modules.items()
    )


def pack(modules: dict[str, list[Shard | None]], pin: bool) -> tuple[torch.Tensor, dict[str, list[Shard | None]]]:
    """Every tensor of ``modules`` copied into one flat buffer (pinned when ``pin``), and the same
    modules as contiguous views of it: one allocation to pin, and one DMA to page the adapter in."""
    tensors = [t for shards in modules.values() for shard in shards if shard is not None for t in shard]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=pin)
    offset = 0

    def place(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        view = flat[offset : offset + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        offset += tensor.numel()
        return view

    packed = {
        name: [None if shard is None else (place(shard[0]), place(shard[1])) for shard in shards]
        for name, shards in modules.items()
    }
    return flat, packed


def _read_config(path: str, fail) -> dict:
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise fail(f"cannot read {CONFIG_FILE}: {exc}") from None
    problem = config_problem(config) if isinstance(config, dict) else f"{CONFIG_FILE} is not an object"
    if problem is not None:
        raise fail(problem)
    return config


def _read_pairs(path: str, fail) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """checkpoint module name -> (A, B), every tensor accounted for."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    except (OSError, SafetensorError) as exc:
        raise fail(f"cannot read {WEIGHTS_FILE}: {exc}") from None
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or tensor.dim() != 2:
            raise fail(f"tensor {key} is not a lora_A / lora_B weight (embedding adapters are not supported)")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor
    lonely = [module for module, ab in halves.items() if len(ab) != 2]
    if lonely:
        raise fail(f"{lonely[0]} has lora_A or lora_B but not both")
    return {module: (ab["A"], ab["B"]) for module, ab in halves.items()}
