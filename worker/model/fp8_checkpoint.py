"""Pre-quantised FP8 checkpoints, loaded as published.

Two layouts, both e4m3 weights ``*.weight`` [out, in] with fp32 scales beside them
(real weight = FP8 weight x scale), announced by config.json's ``quantization_config``:

- HF / vLLM ``"quant_method": "fp8"`` (AutoFP8, llm-compressor's FP8 export,
  transformers' FP8 config): ``weight_scale`` one per tensor ([] or [1]); with
  ``"weight_block_size": [bn, bk]``, ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)]
  instead, one per block (multiplied, despite its name);
- compressed-tensors ``"format": "float-quantized"`` (``config_groups`` whose
  ``weights`` are ``type: float, num_bits: 8``): ``weight_scale`` [out, 1] for the
  ``channel`` strategy, [1] for ``tensor``, [out/bn, in/bk] for ``block``. Groups
  without ``input_activations`` are weights-only (``lightq quantize`` writes these):
  they run as ``--quantization fp8_w8a16`` unless ``--quantization fp8`` is given.

lightq keeps one scale per output channel (``worker.model.fp8.Fp8Linear``): per-tensor
scales are repeated over their rows, exactly; block-scaled weights are dequantised here
and requantised per channel as they load (not bit-exact: the one lossy case). Static
activation scales (``input_scale``) and KV scales (``k_scale``, ``v_scale``) are dropped:
lightq scales activations per token and the KV pool per token and head, as they run.

Which layers are FP8 is read off the files, not the config's ignore lists: a ``Linear``
is FP8 when a checkpoint weight mapping to it is stored as F8_E4M3 (the safetensors
header says so without reading the data); a fused layer with one such shard is FP8 whole
and its full-precision shards are quantised as they load.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from worker.model.quant import FP8

WeightStream = Iterator[tuple[str, torch.Tensor]]

# Scales lightq computes as it runs instead (static activation scales, the KV cache's).
DROPPED = (".input_scale", ".k_scale", ".v_scale", ".kv_scale", ".q_scale")


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "fp8" or "compressed-tensors"
    block: tuple[int, int] | None  # [bn, bk] of block scales, None for per-tensor / per-channel
    # compressed-tensors groups without ``input_activations`` (``lightq quantize`` writes these):
    # the weights alone are FP8, so the layers run W8A16 unless --quantization fp8 asks otherwise
    weights_only: bool = False


def checkpoint_format(config) -> Fp8Format | None:
    """The FP8 layout a config's ``quantization_config`` announces (None: not quantised);
    ValueError for a quantisation lightq does not load."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint in {qc.get('fmt')!r}: lightq loads e4m3")
        block = qc.get("weight_block_size")
        return Fp8Format("fp8", tuple(block) if block else None)
    if method == "compressed-tensors":
        groups = (qc.get("config_groups") or {}).values()
        weights_only = bool(groups) and not any(group.get("input_activations") for group in groups)
        return Fp8Format("compressed-tensors", _compressed_tensors_block(qc), weights_only)
    raise ValueError(
        f"quantization_config quant_method {method!r}: lightq loads FP8 checkpoints only "
        "('fp8', or compressed-tensors' 'float-quantized')"
    )


def _compressed_tensors_block(qc: dict) -> tuple[int, int] | None:
    if qc.get("format") != "float-quantized":
        raise ValueError(f"compressed-tensors format {qc.get('format')!r}: lightq loads 'float-quantized' (FP8)")
    blocks = set()
    for group in (qc.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True):
            raise ValueError(f"compressed-tensors weights {weights}: lightq loads symmetric 8-bit float only")
        if weights.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"compressed-tensors strategy {weights.get('strategy')!r}: tensor, channel or block")
        block = weights.get("block_structure")
        blocks.add(tuple(block) if weights.get("strategy") == "block" and block else None)
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different block structures {blocks}")
    return blocks.pop() if blocks else None


def fp8_weights(folder: str) -> list[str]:
    """Names of the checkpoint's ``*.weight`` tensors stored as F8_E4M3 (read from the headers)."""
    from safetensors import safe_open

    names = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                dtype = f.get_slice(name).get_dtype()
                if dtype == "F8_E5M2":
                    raise ValueError(f"{name} is F8_E5M2: lightq loads e4m3 FP8 weights")
                if dtype == "F8_E4M3" and name.endswith(".weight"):
                    names.append(name)
    return names


def adapt(stream: WeightStream, fmt: Fp8Format) -> WeightStream:
    """The checkpoint's tensors as ``CausalLM.load_weights`` takes them: dropped scales left out,
    a zero point checked to be zero, and block-scaled weights paired with their scales and
    dequantised to fp32 (``load_weights`` quantises them per channel)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if name.endswith(DROPPED):
            continue
        if name.endswith(".weight_zero_point"):
            if tensor.count_nonzero():
                raise ValueError(f"{name}: a non-zero zero point (asymmetric FP8 is not supported)")
            continue
        module, _, kind = name.rpartition(".")
        is_block_part = kind in ("weight_scale", "weight_scale_inv") or (kind == "weight" and tensor.dtype == FP8)
        if fmt.block is None or not is_block_part:
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts["scale" if kind != "weight" else "weight"] = tensor
        if len(parts) == 2:
            del pending[module]
            yield f"{module}.weight", dequantize_blocks(parts["weight"], parts["scale"], fmt.block)
    if pending:
        raise ValueError(
            f"block-scaled FP8 weights without their scales (or scales without weights): {sorted(pending)[:3]}"
        )


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] FP8 x scale [ceil(out/bn), ceil(in/bk)] per block -> fp32 [out, in]."""
    out_features, in_features = weight.shape
    bn, bk = block
    full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:out_features, :in_features]
    return weight.float() * full
