"""Where FP8's error on a model comes from: weights, activations, a layer kind kept in full precision.

    python -m bench.engine.fp8_breakdown [--model default] [--seqs 4] [--seq-len 320]

The model's own linear layers run each variant's arithmetic in its dtype (fp32 on a CPU, the reference
of ``bench.engine.fp8_accuracy``): a weight quantised per output channel (or per group of ``--group`` along
its rows) and dequantised, an input quantised per token (or per group) and dequantised, as
``worker.model.quant.quantize_rows`` does; the KV pool stays full precision. Each variant scores the
same sampled text as the unquantised model (``bench.engine.fp8_accuracy``'s sampler) and prints one line:
perplexity against the reference, mean KL(reference || variant) and top-1 agreement.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from shared.model_files import resolve
from worker.model.gptq import gptq_fp8
from worker.model.layers import Linear
from worker.model.loader import load_model
from worker.model.quant import dequantize_rows, quantize_rows
from worker.runner.sequence_pool import SequencePool, sample_text


def fake(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x quantised and dequantised per row of its last dim, or per ``group`` of it."""
    if group is None:
        return dequantize_rows(*quantize_rows(x))
    shape = x.shape
    return dequantize_rows(*quantize_rows(x.reshape(*shape[:-1], shape[-1] // group, group))).reshape(shape)


VARIANTS = {  # name -> (weights' group or "none", inputs' group or "none", layer kinds kept full, smoothing alpha)
    "weights + inputs (lightq's)": (None, None, (), None),
    "weights only": (None, "none", (), None),
    "inputs only": ("none", None, (), None),
    "weights + inputs, groups of 64": (64, 64, (), None),
    "weights + inputs, down_proj full": (None, None, ("down_proj",), None),
    "weights + inputs, o_proj full": (None, None, ("o_proj",), None),
    "weights + inputs, smoothed a=0.5": (None, None, (), 0.5),
    "weights + inputs, smoothed a=0.7": (None, None, (), 0.7),
    "weights + inputs, smoothed a=0.5, down_proj full": (None, None, ("down_proj",), 0.5),
    "weights GPTQ-rounded only": ("gptq", "none", (), None),
    "weights GPTQ-rounded + inputs": ("gptq", None, (), None),
    "weights GPTQ-rounded + inputs, down_proj full": ("gptq", None, ("down_proj",), None),
    "weights GPTQ-rounded + inputs per group of 64": ("gptq", 64, (), None),
    "weights GPTQ-rounded + inputs per group of 64, down_proj full": ("gptq", 64, ("down_proj",), None),
    "weights GPTQ act-order only": ("gptq-act", "none", (), None),
    "weights GPTQ act-order + inputs": ("gptq-act", None, (), None),
    "weights GPTQ act-order + inputs, down_proj full": ("gptq-act", None, ("down_proj",), None),
}


def input_stats(model, pool: SequencePool, text: torch.Tensor, linears: dict) -> tuple[dict, dict]:
    """Each linear's largest |input| per input channel, and its inputs' Gram matrix X^T X / n, over
    ``text`` (a calibration text)."""
    amax: dict[str, torch.Tensor] = {}
    gram: dict[str, torch.Tensor] = {}

    def seen(name: str, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        amax[name] = torch.maximum(amax.get(name, x.new_zeros(x.shape[-1])), x.abs().amax(0))
        gram[name] = gram.get(name, 0) + x.T @ x / len(text.reshape(-1))

    for name, (m, _) in linears.items():
        m.forward = lambda x, m=m, name=name: (seen(name, x), F.linear(x, m.weight, m.bias))[1]
    pool.prefill(model, text, all_logits=False)
    return amax, gram


def smoothing(xmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s (x / s and W * s multiply to the same product): they
    move part of the activations' outliers into the weights, where per-channel scales absorb them."""
    wmax = weight.abs().amax(0).clamp(min=1e-5)
    return (xmax.clamp(min=1e-5) ** alpha / wmax ** (1 - alpha)).clamp(min=1e-5)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default="", help="run only the variants whose name contains this")
    args = parser.parse_args(argv)
    device = torch.device("cpu")
    model, _ = load_model(resolve(args.model), torch.float32, device)
    pool = SequencePool(model, torch.float32, args.seqs, args.seq_len, device)
    text = sample_text(model, pool, args.seqs, args.seq_len, model.config.vocab_size, args.seed)
    keep = torch.ones_like(text, dtype=torch.bool)
    keep[:, -1] = False
    keep, targets = keep.reshape(-1), text[:, 1:].reshape(-1)

    def score() -> torch.Tensor:
        return torch.log_softmax(pool.prefill(model, text, all_logits=True).float(), -1)[keep]

    ref = score()
    ref_nll = -float(ref.gather(1, targets[:, None]).mean())
    linears = {n: (m, m.weight.data.clone()) for n, m in model.named_modules() if isinstance(m, Linear)}
    print(f"{args.model}: {args.seqs} x {args.seq_len} tokens, reference fp32 ppl {math.exp(ref_nll):.3f}")
    calibration = sample_text(model, pool, args.seqs, args.seq_len, model.config.vocab_size, args.seed + 1)
    xmax, gram = input_stats(model, pool, calibration, linears)  # another text than the one scored
    rounded: dict = {}  # layer -> its GPTQ-rounded weight, and "kind": which rounding they are
    for name, (w_group, x_group, full, alpha) in VARIANTS.items():
        if args.only not in name:
            continue
        if w_group in ("gptq", "gptq-act") and rounded.get("kind") != w_group:
            act = w_group == "gptq-act"
            rounded = {
                layer: dequantize_rows(*gptq_fp8(weight, gram[layer], act_order=act))
                for layer, (_, weight) in linears.items()
            }
            rounded["kind"] = w_group
        for layer, (m, weight) in linears.items():
            kept = any(kind in layer for kind in full)
            s = smoothing(xmax[layer], weight, alpha) if alpha is not None and not kept else torch.ones(1)
            if w_group in ("gptq", "gptq-act"):
                m.weight.data.copy_(weight if kept else rounded[layer])
            else:
                m.weight.data.copy_(weight if kept or w_group == "none" else fake(weight * s, w_group))
            inputs = None if kept or x_group == "none" else x_group
            m.forward = lambda x, m=m, g=inputs, off=kept or x_group == "none", s=s: F.linear(
                x if off else fake(x / s, g), m.weight, m.bias
            )
        logp = score()
        nll = -float(logp.gather(1, targets[:, None]).mean())
        kl = float((ref.exp() * (ref - logp)).sum(-1).mean())
        top1 = float((logp.argmax(-1) == ref.argmax(-1)).float().mean())
        print(f"fp8_breakdown {name:<50} ppl {math.exp(nll - ref_nll) - 1:+7.2%}  KL {kl:.4f}  top-1 {top1:.2%}")


if __name__ == "__main__":
    main()
