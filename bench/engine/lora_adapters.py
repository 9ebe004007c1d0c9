"""Random LoRA adapters in PEFT's format for a shape of ``bench.engine.shapes``: what
``bench.engine.offline --lora-adapters N`` serves (issue 32's throughput goals: 100 adapters of rank 16,
and 1,000 registered with at most 64 resident, ``register_many``).

Each adapter is a folder as PEFT saves one: ``adapter_config.json`` and
``adapter_model.safetensors`` with ``lora_A`` [r, in] and ``lora_B`` [out, r] for every attention
and MLP projection of every layer (the hard case: all seven targets). B is random too, not PEFT's
zero start, so every adapter's delta is real work and changes the output. bf16 on disk; the
Llama-3-8B shape at rank 16 is 84 MB an adapter. Folders already written (same shape, rank and
seed) are kept, so a second run in one machine's life skips the writing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from bench.engine.shapes import SHAPES
from worker.lora.adapter import load_adapter, parse_spec
from worker.lora.adapter_set import AdapterSet

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def projection_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """Each projection's (out, in) features in a Llama-like layer of ``shape``."""
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape.get("head_dim", hidden // heads)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }


def write_adapter(path: Path, shape: dict, rank: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for name, (out, inp) in projection_shapes(shape).items():
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if name in ATTENTION else 'mlp'}.{name}"
            # scaled so the delta is of the order of a layer's own output, as a trained adapter's is
            tensors[f"{module}.lora_A.weight"] = (torch.randn(rank, inp, generator=generator) / inp**0.5).bfloat16()
            tensors[f"{module}.lora_B.weight"] = (torch.randn(out, rank, generator=generator) * 0.02).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "bias": "none",
        "target_modules": [*ATTENTION, *MLP],
    }
    (path / "adapter_config.json").write_text(json.dumps(config))  # last: a folder with it is whole


def write_adapters(shape_name: str, count: int, rank: int, root: Path, seed: int = 0) -> list[str]:
    """``count`` adapters under ``root``; their ``--lora_modules`` specs (NAME=PATH)."""
    specs = []
    for i in tqdm(range(count), desc=f"LoRA adapters (rank {rank})", unit="adapter", mininterval=2):
        path = root / f"{shape_name}-r{rank}-s{seed + i}"
        if not (path / "adapter_config.json").exists():
            write_adapter(path, SHAPES[shape_name], rank, seed + i)
        specs.append(f"a{i}={path}")
    return specs


def register_many(adapters: AdapterSet, model: nn.Module, specs: list[str], count: int, max_rank: int) -> list[str]:
    """``count`` run-time adapters, ``r0`` .. ``r<count-1>``, over the files of ``specs`` in turn (name
    i: file i mod len(specs)), registered in ``adapters`` (host memory; paged into its slots as
    requests need them). Names of one file share its host tensors but are distinct adapters to the
    worker, each paged into a slot of its own: the device's work is that of ``count`` adapters, while
    the host holds len(specs) (1,000 of Llama-3-8B's shape at rank 16 are 84 GB of files and as much
    host memory in bf16: over the benchmark host's disk)."""
    loaded = [load_adapter(*parse_spec(spec), model, max_rank) for spec in specs]
    names = [f"r{i}" for i in range(count)]
    for i, name in enumerate(tqdm(names, desc="registering", unit="adapter", mininterval=2)):
        adapters.register(dataclasses.replace(loaded[i % len(loaded)], name=name))
    return names
