"""FP8 (e4m3) linear layers, put into a built model (gpt-fast's way), never written into a model file.

``Fp8Linear`` holds W as FP8 [out, in] with one fp32 scale per output channel
(``weight_scale`` [out]); its input is quantised per token as it arrives (dynamic
scales: no calibration, an outlier token costs only its own row's precision), or
taken as it comes (``keep_inputs``: W8A16, --quantization fp8_w8a16).
The arithmetic is the layer's ``ops.fp8_linear``: cuBLASLt's ``torch._scaled_mm``
on CUDA (and a W8A16 GEMV for a small decode step), the PyTorch reference
elsewhere (``worker.model.ops``).

Two ways in:
- ``quantize(model)``: every ``Linear`` of a model loaded in bf16/fp16/fp32 (a
  checkpoint, a dequantised GGUF, dummy weights) replaced by its FP8 version,
  one at a time, so the peak is one layer's extra copy (``--quantization fp8``);
- ``prepare(model, names)``: the named ``Linear`` modules replaced by empty FP8
  ones before a pre-quantised checkpoint is loaded into them
  (``worker.model.fp8_checkpoint``); ``fit_weight`` and ``fit_scale`` are what
  ``CausalLM.load_weights`` asks of each tensor bound for an FP8 layer.

The embeddings and the output layer stay in the model dtype: they are not
``Linear`` modules (``VocabEmbedding``, ``VocabHead``), the head is 5% of an 8B
model's weight bytes, and its logits are what the sampler and every accuracy
figure read.

Tensor parallel: a column-split layer keeps its rows' scales (``tp_dim`` 0); a
row-split one keeps every output channel's scale, and its input is quantised
per token over this rank's slice, its own scale per rank; the partial products
are scaled before the all-reduce sums them.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from worker.model.layers import Linear, TensorParallel
from worker.model.ops import ops_for
from worker.model.quant import FP8, QuantizedRows, quantize_rows

log = logging.getLogger("lightq.worker")

# torch._scaled_mm wants both of W's dims to be multiples of 16; a layer that is not stays as it is.
ALIGN = 16


class Fp8Linear(nn.Module):
    """y = x (W * weight_scale)^T (+ b), W FP8 [out, in]; as ``Linear`` (split, all-reduce) otherwise."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        tp: TensorParallel,
        reduce: bool,
        tp_dim: int | None,
    ):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if tp_dim is not None:
            self.weight.tp_dim = tp_dim
            if tp_dim == 0:  # column split: the scales and the bias follow the rows
                self.weight_scale.tp_dim = 0
                if self.bias is not None:
                    self.bias.tp_dim = 0
        self.tp = tp
        self.reduce = reduce
        self.ops = ops_for(weight.device)
        self.quantize_inputs = True  # False: W8A16 (``keep_inputs``, --quantization fp8_w8a16)

    @property
    def takes_quantized_rows(self) -> bool:
        """The norm or SiLU-and-mul before may quantise this layer's input (``QuantizedRows``)."""
        return self.quantize_inputs

    @classmethod
    def empty_like(cls, linear: Linear) -> Fp8Linear:
        """Uninitialised FP8 weights and scales of ``linear``'s shape (its bias kept), for a loader to fill."""
        out_features, in_features = linear.weight.shape
        device = linear.weight.device
        weight = torch.empty(out_features, in_features, dtype=FP8, device=device)
        scale = torch.empty(out_features, dtype=torch.float32, device=device)
        return cls(weight, scale, _bias(linear), linear.tp, linear.reduce, getattr(linear.weight, "tp_dim", None))

    @classmethod
    def quantized(cls, linear: Linear) -> Fp8Linear:
        """``linear``'s weights, quantised per output channel."""
        weight, scale = quantize_rows(linear.weight.data)
        return cls(weight, scale, _bias(linear), linear.tp, linear.reduce, getattr(linear.weight, "tp_dim", None))

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if not self.reduce:
            return self.ops.fp8_linear(x, self.weight, self.weight_scale, self.bias, self.quantize_inputs)
        y = self.tp.all_reduce(self.ops.fp8_linear(x, self.weight, self.weight_scale, None, self.quantize_inputs))
        return y if self.bias is None else y + self.bias


def _bias(linear: Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.data


def fits(linear: Linear) -> bool:
    out_features, in_features = linear.weight.shape
    return out_features % ALIGN == 0 and in_features % ALIGN == 0


def linear_modules(model: nn.Module) -> dict[str, Linear]:
    """Every ``Linear`` of ``model`` by module name (the output layer and embeddings are not ``Linear``)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear)}


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


@torch.no_grad()
def quantize(model: nn.Module) -> int:
    """Replace every ``Linear`` of ``model`` whose dims fit FP8 GEMMs by its ``Fp8Linear``; the count
    replaced. The full-precision weight of each is dropped as soon as its FP8 copy exists."""
    count = 0
    for name in list(linear_modules(model)):  # names only: each old layer is dropped once replaced
        linear = model.get_submodule(name)
        if not fits(linear):
            log.warning("%s %s: dims not multiples of %d, kept in %s", name, tuple(linear.weight.shape), ALIGN,
                        linear.weight.dtype)  # fmt: skip
            continue
        _replace(model, name, Fp8Linear.quantized(linear))
        del linear
        count += 1
    _release(model)
    return count


def keep_inputs(model: nn.Module) -> int:
    """Every ``Fp8Linear`` of ``model`` takes its input as it comes (W8A16): FP8's error is then the
    weights' alone, about two thirds of W8A8's KL on SmolLM2 (bench/RESULTS.md). The count."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in layers:
        m.quantize_inputs = False
    return len(layers)


def prepare(model: nn.Module, names: set[str]) -> None:
    """Replace the ``Linear`` modules named in ``names`` by empty ``Fp8Linear`` ones (a pre-quantised
    checkpoint's FP8 layers); a name that is not a ``Linear`` of this model is a ValueError."""
    linears = linear_modules(model)
    unknown = sorted(names - set(linears))
    if unknown:
        raise ValueError(f"FP8 tensors for {unknown[:3]}: not linear layers of {type(model).__name__}")
    for name in sorted(names):
        if not fits(linears[name]):
            raise ValueError(f"{name} {tuple(linears[name].weight.shape)}: FP8 needs dims divisible by {ALIGN}")
        _replace(model, name, Fp8Linear.empty_like(linears[name]))
    _release(model)


def _release(model: nn.Module) -> None:
    """Hand the dropped full-precision weights back to the device, so the KV pool can be sized over them."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_device(device: torch.device | str, what: str) -> None:
    """FP8 on CUDA needs FP8 tensor cores and conversions: compute capability 8.9 (Ada) or 9.0 (Hopper) and
    up; elsewhere a ValueError naming the card, at start-up, not a compile error in the first forward."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"{what} needs a GPU of compute capability 8.9 or later (Ada, Hopper); {device} is {major}.{minor}"
        )


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


def fit_weight(name: str, tensor: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A checkpoint weight (this rank's slice) for ``dst``, an ``Fp8Linear`` weight or a shard of it:
    (what to copy into dst, and the scales of its rows when it came in full precision, for the caller
    to copy into the same shard of ``weight_scale``; else None). An FP8 weight is copied as it is; a
    full-precision one (a layer the checkpoint left unquantised, fused here with quantised ones: q_proj
    beside k_proj, say, or a block-scaled one ``fp8_checkpoint`` dequantised) is quantised per output
    channel now."""
    if tensor.dtype == FP8:
        return tensor, None
    if tensor.is_floating_point() and tensor.element_size() > 1:
        return quantize_rows(tensor.to(dst.device))
    raise ValueError(f"{name}: {tensor.dtype} for an FP8 weight")


def fit_scale(tensor: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """A checkpoint's weight scale (this rank's slice) for ``dst``, a shard of ``weight_scale`` [out]:
    [out, 1] (compressed-tensors' channel strategy) is flattened, and one per tensor ([] or [1]: the
    fp8 method, compressed-tensors' tensor strategy) is repeated over the rows, exactly (a per-tensor
    scale is a per-channel scale with equal entries)."""
    scale = tensor.float().reshape(-1)
    return scale.expand(dst.shape) if scale.numel() == 1 else scale
