"""Build a lightq model on its device and fill its weights.

Start-up, in this order (the KV pool is sized from what the weights leave)::

    model, config = load_model(source, dtype, device)          # weights on device
    num_slots = <free memory> // KVCache.bytes_per_token(model.num_layers,
                                    model.num_kv_heads, model.head_dim, dtype)
    cache = attach_kv_cache(model, num_slots, device)          # pool + backend
    logits = model(batch)                                      # [B, vocab] fp32

Weights go straight into the model's parameters, which are allocated once on
the target device: tensors are streamed from the checkpoint one at a time and
dropped after the copy, so no second copy of the model stays around. Only
transformers' config, tokenizer and GGUF reading are used, never its models
(a meta-device transformers model only maps GGUF tensor names).

Sources (``shared.model_files.ModelSource``):
- ``hf``: config.json + one or many ``*.safetensors`` in a directory;
- ``gguf``: a .gguf file, dequantised by transformers/gguf (on CPU, fp32), once:
  later starts read the result back (``worker.model.gguf_cache``);
- ``dummy``: config.json of a directory, random N(0, 0.02) weights (norms 1)
  drawn on the device in the target dtype, for benchmarks at real shapes.

FP8 (``worker.model.fp8``): a checkpoint whose config announces FP8
(``worker.model.fp8_checkpoint``) loads its FP8 layers as published, whatever
``quantization`` says; ``quantization="fp8"`` quantises any other source's
linear layers once its weights are in.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn
from tqdm import tqdm

from shared.model_files import ModelSource, load_config
from worker.model import fp8, fp8_checkpoint
from worker.model.attention import make_backend
from worker.model.gguf_cache import cached_weights
from worker.model.kv_cache import KVCache
from worker.model.layers import SINGLE, LayerNorm, RMSNorm, TensorParallel, pack_for_small_batches
from worker.model.models import model_class
from worker.model.ops import is_triton
from worker.model.quant import FP8

WeightStream = Iterator[tuple[str, torch.Tensor]]

log = logging.getLogger("lightq.worker")


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    tp: TensorParallel = SINGLE,
    weights_cache: str = "",
    quantization: str = "none",
) -> tuple[nn.Module, object]:
    """(model with weights on ``device``, no attention backend yet; its transformers config).

    ``seed`` only matters for dummy weights; ``weights_cache`` only for a GGUF: the folder where
    its dequantised tensors are kept for the next start (``worker.model.gguf_cache``; '': none).
    ``tp``: this process's rank in a tensor-parallel group (initialised by the caller); the model
    keeps its shard of every split weight and ``model.num_kv_heads`` is its share.
    ``quantization``: "none", "fp8" (the linear layers' weights and inputs in FP8) or "fp8_w8a16"
    (their weights in FP8, their inputs as they come); "none" with a weights-only FP8 checkpoint
    (``lightq quantize``'s) runs as "fp8_w8a16".
    """
    if quantization not in ("none", "fp8", "fp8_w8a16"):
        raise ValueError(f"quantization {quantization!r}: 'none', 'fp8' or 'fp8_w8a16'")
    config = load_config(source, weights_cache)
    if quantization != "none" or fp8_checkpoint.checkpoint_format(config) is not None:
        fp8.check_device(device, "FP8 weights")
    model = model_class(config)(config, dtype=dtype, device=device, tp=tp)
    if source.kind == "hf":
        load_checkpoint(model, config, source.path)
    elif source.kind == "gguf":
        model.load_weights(cached_weights(source.path, weights_cache, lambda: gguf_weights(source.path, config)))
    elif source.kind == "dummy":
        init_dummy_weights(model, seed)
    else:
        raise ValueError(f"unknown model source kind {source.kind!r}")
    if quantization != "none" and not fp8.is_quantized(model):
        log.info("FP8: %d linear layers quantised per output channel", fp8.quantize(model))
    fmt = fp8_checkpoint.checkpoint_format(config)
    if quantization == "fp8_w8a16" or (quantization == "none" and fmt is not None and fmt.weights_only):
        log.info("FP8: the inputs of %d linear layers kept in %s (W8A16)", fp8.keep_inputs(model), dtype)
    if not is_triton(device):  # FP8 layers are not packed: on a CPU they are a numerics path
        packed = pack_for_small_batches(model)
        if packed:
            log.info("CPU: decode-sized matmuls through oneDNN, weights packed once (%.0f MiB)", packed / 2**20)
    return model.eval(), config


def load_checkpoint(model: nn.Module, config, folder: str) -> None:
    """A safetensors checkpoint into ``model``; an FP8 one's FP8 layers made FP8 first."""
    fmt = fp8_checkpoint.checkpoint_format(config)
    if fmt is None:
        model.load_weights(safetensors_weights(folder))
        return
    names = {model.checkpoint_target(n)[0].removesuffix(".weight") for n in fp8_checkpoint.fp8_weights(folder)}
    fp8.prepare(model, names)
    log.info("FP8 checkpoint (%s%s): %d linear layers in FP8", fmt.method, f", blocks {fmt.block}" if fmt.block else "",
             len(names))  # fmt: skip
    model.load_weights(fp8_checkpoint.adapt(safetensors_weights(folder), fmt))


def attach_kv_cache(
    model: nn.Module, num_slots: int, device: torch.device | str, kv_dtype: torch.dtype | None = None
) -> KVCache:
    """Allocate the KV pool for ``model`` (in ``kv_dtype``, by default the model's; FP8 keeps a scale per
    token and head beside it) and give the model its backend."""
    dtype = kv_dtype or model.dtype
    if dtype == FP8:
        fp8.check_device(device, "an FP8 KV pool")
    cache = KVCache(model.num_layers, num_slots, model.num_kv_heads, model.head_dim, dtype, device)
    model.set_backend(make_backend(cache, device))
    return cache


def safetensors_weights(folder: str) -> WeightStream:
    """Every tensor of every ``*.safetensors`` in ``folder``, one at a time, on CPU."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    total = 0
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            total += len(f.keys())
    with tqdm(total=total, desc="loading weights", unit="tensor") as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file, not a dict: no iteration)
                    yield name, f.get_tensor(name)
                    bar.update()


def gguf_weights(path: str, config) -> WeightStream:
    """The GGUF's tensors under transformers names, dequantised to fp32 on CPU.

    transformers maps llama.cpp names to its own through a model's state-dict
    names, so it gets a transformers model built on the meta device (no
    memory); it also undoes llama.cpp's Q/K row permutation for rotary.
    The file is dequantised whole; tensors are popped as they are yielded so
    each is freed after its copy.
    """
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        names_only = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=names_only)["tensors"]
    del names_only
    while tensors:
        name = next(iter(tensors))
        yield name, torch.as_tensor(tensors.pop(name))


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights drawn on the parameters' own device and dtype, reproducible by seed.

    Matrices and biases ~ N(0, 0.02) (never zeros: zeros would make every
    logit equal); norm weights 1, as a trained model's are near 1, and norm
    biases 0. Norms are found by module type: BLOOM's are named ``ln_f`` too.
    Under tensor parallelism every rank draws the same sequence, so the
    replicated parameters (norms, row-parallel biases) agree across ranks.
    """
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    norms = [m for m in model.modules() if isinstance(m, (RMSNorm, LayerNorm))]
    norm_weights = {id(m.weight) for m in norms}
    norm_biases = {id(m.bias) for m in norms if getattr(m, "bias", None) is not None}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif id(param) in norm_biases:
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
