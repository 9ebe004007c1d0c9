"""``lightq quantize``: a model's linear weights rounded to FP8 by GPTQ, written as a checkpoint.

    lightq quantize --model_dir default --out ./smollm2-fp8          # the embedded SmolLM2
    lightq quantize --model_dir /models/llama3-8b --out ./l3-fp8 --calibration corpus.txt
    lightq serve --model_dir ./smollm2-fp8                           # runs W8A16: FP8 weights, full inputs

The source (a safetensors folder or a GGUF) is loaded unquantised (bf16 on a GPU, fp32 on a CPU),
run over a calibration text (``--calibration``, a UTF-8 file; by default text sampled from the model
itself at temperature 1 from seeded first tokens), and every linear layer's weight rounded by GPTQ
against its inputs (``worker.model.gptq``). The output folder is a compressed-tensors
``float-quantized`` checkpoint (per-channel scales, weights only: no ``input_activations``), which
lightq loads as W8A16 (the layout compressed-tensors' loaders read as weight-only FP8; only lightq's
is tested); every other tensor is copied as it was, the config and tokenizer beside, and
``lightq_quantize.json`` says how it was made. The checkpoint's names are the source's (q/k/v and
gate/up apart): rows are independent under per-channel scales, so each shard is the fused layer's rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: every lightq process builds the CLI's parser, which names this module
    import torch

SHARD_BYTES = 4 << 30  # safetensors files of at most ~4 GiB, as transformers shards


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model_dir", required=True, help="the source: a safetensors folder, a GGUF, or 'default'")
    parser.add_argument("--out", required=True, help="the folder to write (must not exist)")
    parser.add_argument("--calibration", default="", help="a UTF-8 text file (default: text sampled from the model)")
    parser.add_argument("--seqs", type=int, default=16, help="calibration sequences (default 16)")
    parser.add_argument("--seq_len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    parser.add_argument("--no_act_order", action="store_true", help="round columns in their order, not by input size")
    parser.add_argument("--device", default="auto", help="'auto' (cuda when present), 'cuda' or 'cpu'")
    parser.add_argument("--seed", type=int, default=0, help="the sampled calibration text's seed")


def run(flags: dict) -> int:
    args = argparse.Namespace(**flags)
    if os.path.exists(args.out):
        print(f"lightq quantize: {args.out} exists; give a new folder", file=sys.stderr)
        return 2
    if args.calibration and not os.path.isfile(args.calibration):  # before minutes of loading, not after
        print(f"lightq quantize: --calibration {args.calibration}: no such file", file=sys.stderr)
        return 2
    from shared.model_files import resolve

    try:
        source = resolve(args.model_dir)
    except FileNotFoundError as exc:
        print(f"lightq quantize: {exc}", file=sys.stderr)
        return 2
    if source.kind not in ("hf", "gguf"):
        print(f"lightq quantize: {args.model_dir} has no weights to quantise (a {source.kind} source)", file=sys.stderr)
        return 2
    quantize(source, args)
    print(f"lightq quantize: wrote {args.out}; serve it with `lightq serve --model_dir {args.out}` (W8A16)")
    return 0


def quantize(source, args: argparse.Namespace) -> None:
    import torch

    with torch.inference_mode():
        _quantize(source, args)


def _quantize(source, args: argparse.Namespace) -> None:
    import torch
    from tqdm import tqdm

    from shared.config import ModelSettings
    from shared.model_files import load_tokenizer
    from worker.model.gptq import quantize_model
    from worker.model.loader import load_model

    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cache = ModelSettings(model_dir=args.model_dir).weights_cache  # serve's: LIGHTQ_WEIGHTS_CACHE or its default
    model, config = load_model(source, dtype, device, weights_cache=cache)
    try:
        tokenizer = load_tokenizer(source, cache)
    except (OSError, ValueError):  # a folder of weights without one: the sampled text needs none
        tokenizer = None
    text = calibration_text(model, tokenizer, args, dtype, device)
    run_text = text_runner(model, text, dtype, device)
    with tqdm(desc="GPTQ", unit="layer") as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        rounded = quantize_model(model, run_text, act_order=not args.no_act_order, progress=progress)
    os.makedirs(args.out)
    write_weights(args.out, source, config, model, rounded)
    config.quantization_config = quantization_config()
    config.save_pretrained(args.out)
    with open(os.path.join(args.out, "lightq_quantize.json"), "w") as f:  # how, beside the standard config
        json.dump({"method": "gptq", "act_order": not args.no_act_order, "calibration": text_origin(args)}, f)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)


def calibration_text(model, tokenizer, args, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[seqs, seq_len] token ids: the file's text in consecutive windows, or sampled from the model."""
    import torch

    from worker.runner.sequence_pool import SequencePool, sample_text

    if not args.calibration:
        pool = SequencePool(model, dtype, args.seqs, args.seq_len, device)
        return sample_text(model, pool, args.seqs, args.seq_len, model.config.vocab_size, args.seed)
    if tokenizer is None:
        raise SystemExit(f"lightq quantize: {args.model_dir} has no tokenizer for --calibration's text")
    with open(args.calibration, encoding="utf-8") as f:
        ids = tokenizer(f.read(), add_special_tokens=False)["input_ids"]
    windows = min(args.seqs, len(ids) // args.seq_len)
    if windows == 0:
        raise SystemExit(f"lightq quantize: {args.calibration} has {len(ids)} tokens, under one --seq_len window")
    return torch.tensor(ids[: windows * args.seq_len], device=device).view(windows, args.seq_len)


def text_runner(model, text: torch.Tensor, dtype: torch.dtype, device: torch.device, batch: int = 4):
    """A function that runs ``text`` through ``model``, ``batch`` sequences a prefill."""
    from worker.runner.sequence_pool import SequencePool

    pool = SequencePool(model, dtype, batch, text.shape[1], device)

    def run_text() -> None:
        for start in range(0, text.shape[0], batch):
            pool.prefill(model, text[start : start + batch], all_logits=False)

    return run_text


def text_origin(args) -> str:
    if args.calibration:
        return f"{args.calibration}: {args.seqs} x {args.seq_len} tokens at most"
    return f"sampled from the model: {args.seqs} x {args.seq_len} tokens, seed {args.seed}"


def quantization_config() -> dict:
    """compressed-tensors' description of FP8 weights with a scale per output channel, inputs as they come."""
    weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    weights["actorder"] = None  # per-channel scales: act-order changes the rounding, not the layout
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


def write_weights(out: str, source, config, model, rounded: dict) -> None:
    """The source's tensors under their names, each linear weight as its FP8 rows and ``weight_scale``
    [rows, 1]; in ~4 GiB safetensors files with transformers' index."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    files: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, tensor in fp8_tensors(source_weights(source, config), model, rounded):
        shard[name] = tensor.contiguous()
        size += tensor.numel() * tensor.element_size()
        if size >= SHARD_BYTES:
            files.append(shard)
            shard, size = {}, 0
    files += [shard] if shard else []
    index = {}
    for i, tensors in enumerate(files):
        file = "model.safetensors" if len(files) == 1 else f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, os.path.join(out, file), metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, file))
    if len(files) > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": index}, f, indent=1)


def source_weights(source, config):
    from worker.model.loader import gguf_weights, safetensors_weights

    return gguf_weights(source.path, config) if source.kind == "gguf" else safetensors_weights(source.path)


def fp8_tensors(stream, model, rounded: dict):
    """(name, tensor) of the output checkpoint: a quantised layer's weight (or a shard of a fused
    one) as its e4m3 rows and their scales, everything else unchanged."""
    for name, tensor in stream:
        target, shard = model.checkpoint_target(name)
        module = target.removesuffix(".weight")
        if not name.endswith(".weight") or module not in rounded:
            yield name, tensor
            continue
        fp8, scale = rounded[module]
        sizes = model.shard_sizes(target, fp8) or [fp8.shape[0]]
        rows = slice(sum(sizes[:shard]), sum(sizes[: shard + 1]))
        if fp8[rows].shape != tensor.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} is not rows {rows} of {module} {tuple(fp8.shape)}")
        yield name, fp8[rows]
        yield name.removesuffix(".weight") + ".weight_scale", scale[rows, None].float()
