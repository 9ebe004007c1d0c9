"""GPTQ rounding of linear weights to FP8: what ``lightq quantize`` writes.

Rounding each weight to its nearest FP8 value (what ``--quantization fp8`` does at load) minimises
each weight's error; GPTQ (Frantar et al. 2022, arXiv 2210.17323) minimises the layer's *output*
error on real inputs instead: it rounds a weight matrix column by column and spreads each column's
rounding error over the columns not yet rounded, weighted by the inverse of the inputs' Gram
matrix ``H = X^T X / n``. With "act-order" the columns of the largest inputs go first, so their
error is spread over the most columns. Scales stay per output channel (lightq's ``Fp8Linear``), so
rows are independent: a fused layer (qkv, gate_up) rounded whole equals its shards rounded apart.

On SmolLM2-135M (``bench.engine.fp8_breakdown``, bench/RESULTS.md) FP8 weights rounded to nearest
cost +3.7% perplexity and 0.037 nats of KL with FP8 inputs, +2.25% / 0.023 with inputs kept (W8A16);
act-order GPTQ weights with inputs kept: +0.87% / 0.016.

The Gram matrices come from the unquantised model on a calibration text (one pass per group of
layers, so their memory stays under ``gram_budget`` bytes: a Llama-3-8B down_proj's alone is 0.8 GB).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from worker.model.fp8 import fits, linear_modules
from worker.model.quant import FP8, FP8_MAX, dequantize_rows, quantize_rows


@torch.no_grad()
def gptq_fp8(
    weight: torch.Tensor, gram: torch.Tensor, block: int = 128, damp: float = 0.01, act_order: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] rounded to FP8 by GPTQ against the inputs' Gram matrix ``gram`` [K, K]:
    (the e4m3 weight [N, K], its fp32 scales [N]); the real weight is their product. The scales are
    round-to-nearest's (each row's amax / 448): GPTQ changes which value each weight rounds to."""
    w = weight.float().clone()
    h = gram.to(w.device, torch.float32).clone()
    order = torch.argsort(h.diagonal(), descending=True) if act_order else None
    if order is not None:
        w, h = w[:, order], h[order][:, order]
    dead = h.diagonal() == 0  # inputs never seen: their weights cannot matter, round them to zero
    h[dead, dead], w[:, dead] = 1.0, 0.0
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], device=h.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scale = quantize_rows(weight.float())[1]  # [N], from the weight as given
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)  # the e4m3 bytes, column by column
    for start in range(0, w.shape[1], block):
        end = min(start + block, w.shape[1])
        wb, errs = w[:, start:end].clone(), torch.empty(w.shape[0], end - start, device=w.device)
        for j in range(end - start):
            col = wb[:, j]
            fp8 = (col / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            codes[:, start + j] = fp8.view(torch.uint8)
            err = (col - dequantize_rows(fp8[:, None], scale)[:, 0]) / hinv[start + j, start + j]
            wb[:, j:] -= err[:, None] * hinv[start + j, start + j : end][None, :]
            errs[:, j] = err
        w[:, end:] -= errs @ hinv[start:end, end:]
    if order is not None:
        codes = codes[:, torch.argsort(order)]
    return codes.view(FP8), scale


def output_error(weight: torch.Tensor, rounded: torch.Tensor, gram: torch.Tensor) -> float:
    """The mean squared output error of ``rounded`` against ``weight`` on inputs of Gram ``gram``:
    trace((W - Q) H (W - Q)^T) / N, what GPTQ minimises (round-to-nearest does not look at H)."""
    diff = weight.float() - rounded.float()
    return float(((diff @ gram.float()) * diff).sum() / weight.shape[0])


@torch.no_grad()
def collect_grams(model: nn.Module, names: Iterable[str], run: Callable[[], None]) -> dict[str, torch.Tensor]:
    """The Gram matrix X^T X / n of each named ``Linear``'s inputs while ``run()`` runs the model on
    the calibration text, on the layer's device."""
    grams: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for name in names:

        def seen(module, inputs, _out, name=name):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            gram = x.T @ x
            grams[name] = grams[name] + gram if name in grams else gram
            counts[name] = counts.get(name, 0) + x.shape[0]

        hooks.append(model.get_submodule(name).register_forward_hook(seen))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return {name: g / counts[name] for name, g in grams.items()}


def quantize_model(
    model: nn.Module,
    run: Callable[[], None],
    act_order: bool = True,
    gram_budget: int = 4 << 30,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every ``Linear`` of ``model`` whose dims fit FP8 GEMMs, GPTQ-rounded: module name -> (e4m3
    weight, fp32 scales [N]), on the CPU. ``run()`` runs the calibration text through the (unchanged)
    model once per group of layers whose Gram matrices fit ``gram_budget`` bytes together."""
    linears = {name: m for name, m in linear_modules(model).items() if fits(m)}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    groups, group, size = [], [], 0
    for name, m in linears.items():
        need = m.weight.shape[1] ** 2 * 4
        if group and size + need > gram_budget:
            groups.append(group)
            group, size = [], 0
        group.append(name)
        size += need
    groups += [group] if group else []
    for names in groups:
        grams = collect_grams(model, names, run)
        for name in names:
            weight = linears[name].weight
            fp8, scale = gptq_fp8(weight, grams.pop(name), act_order=act_order)
            out[name] = (fp8.cpu(), scale.cpu())
            progress(len(out), len(linears))
    return out
