"""Building blocks of lightq's decoders (Llama family, BLOOM), numerically matching transformers.

Parameters are allocated uninitialised (``torch.empty``) on the target device
and dtype, never on CPU first: a checkpoint or the dummy initialiser fills
every one of them (the loader checks), so initialising would be wasted work.
No autograd: parameters have ``requires_grad=False``.

Tensor parallelism (``TensorParallel``, size N > 1): a ``Linear`` built with
split="column" holds rank r's rows of W (its share of the outputs: heads, MLP
columns), split="row" holds rank r's columns and sums the partial products
over the group (one all-reduce). A split parameter carries ``tp_dim``, the
dim the loader slices checkpoint tensors along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from worker.model.ops import ops_for
from worker.model.quant import QuantizedRows


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (one process per GPU).

    size 1, the default, never touches torch.distributed; otherwise the
    process group (``group``, None for the default one) must be initialised.
    """

    rank: int = 0
    size: int = 1
    group: object = None  # torch.distributed ProcessGroup

    def part(self, n: int, what: str) -> int:
        """This rank's share of n (heads, features, vocabulary rows)."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must be divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In-place sum over the group."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] from each rank -> [..., size * n], rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()


class Linear(nn.Module):
    """y = x W^T (+ b), W: [out, in]; the same names as nn.Linear.

    split="column": W holds out/N rows (b too), y is this rank's out/N outputs.
    split="row": W holds in/N columns, x is this rank's in/N inputs, y the
    full sum over ranks; b is whole and added once, after the sum.
    """

    # Whether this layer takes its input quantised per token (``worker.model.quant.QuantizedRows``):
    # only an FP8 linear that quantises its inputs does (``Fp8Linear``), so the kernel before it may.
    takes_quantized_rows = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
        split: str | None = None,
    ):
        super().__init__()
        assert split in (None, "column", "row"), split
        if split == "column":
            out_features = tp.part(out_features, "output features")
        elif split == "row":
            in_features = tp.part(in_features, "input features")
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        if split is not None:
            self.weight.tp_dim = 0 if split == "column" else 1
        if split == "column" and bias:
            self.bias.tp_dim = 0
        self.tp = tp
        self.reduce = split == "row" and tp.size > 1
        self.small: SmallBatchGemm | None = None  # set by pack_for_small_batches (CPU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.shape[0] <= self.small.max_rows:
            return self.small(x)
        if not self.reduce:
            return F.linear(x, self.weight, self.bias)
        y = self.tp.all_reduce(F.linear(x, self.weight))  # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias


class SmallBatchGemm:
    """y = x W^T (+ b) for at most ``max_rows`` rows of x, through oneDNN with W packed once (CPU, fp32,
    and bf16 where oneDNN runs it natively: AVX-512 BF16 or AMX).

    A decode step multiplies a few dozen rows by every weight. At 32 rows on the 2-core sandbox,
    torch's default CPU path (``F.linear``, MKL) ran SmolLM2's matmuls at 44-98 GFLOP/s, oneDNN on
    weights packed beforehand at 103-134 (the 49,152-row output layer: 44 vs 103); at thousands of
    rows (a prefill) ``F.linear`` was as fast or faster, so larger inputs keep it. The packed copy
    costs the weight's memory again. In bf16 on the AMD EPYC sandbox (AVX-512 BF16) the packed
    weights ran the same shapes 1.2-1.9x faster than ``F.linear`` (3,072 x 576 at 32 rows: 0.138
    against 0.278 ms; the output layer 2.6 against 4.9). The ops are private ones of torch's oneDNN
    integration (``torch.ops.mkldnn``): ``make`` gives None where this torch lacks them or their
    result disagrees with ``F.linear``.
    """

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, max_rows: int):
        self.packed, self.bias, self.max_rows = packed, bias, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    @classmethod
    def make(cls, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> SmallBatchGemm | None:
        if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available() or not packs(weight.dtype):
            return None
        tolerance = 1e-4 if weight.dtype == torch.float32 else 2e-2  # bf16: 8 bits of mantissa, sums in fp32
        try:
            gemm = cls(
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), min(max_rows, 64)),
                None if bias is None else bias.detach(),
                max_rows,
            )
            x = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
            want = F.linear(x, weight, bias).float()
            if not torch.allclose(gemm(x).float(), want, rtol=tolerance, atol=tolerance * float(want.abs().max())):
                return None
        except (RuntimeError, AttributeError):  # an op this torch does not have, or cannot run here
            return None
        return gemm


def packs(dtype: torch.dtype) -> bool:
    """Whether ``SmallBatchGemm`` takes weights of ``dtype``: fp32, and bf16 where this CPU has native
    bf16 (elsewhere oneDNN emulates it, and the old AVX2 sandbox ran bf16 matmuls at a seventh of fp32's)."""
    if dtype == torch.float32:
        return True
    try:  # a private op: a torch without it packs no bf16
        return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX): where ``--dtype auto`` picks bf16 on a
    CPU. torch's own probes (private ones: a torch without them says no)."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


SMALL_BATCH_ROWS = 64  # a Linear's decode-sized inputs: at 128 rows MKL was as fast for some shapes
PACK_BUDGET_BYTES = 2 << 30  # packed copies double the weights' memory: models up to ~0.5 B params (fp32)


def pack_for_small_batches(model: nn.Module, head_rows: int = 1 << 20) -> int:
    """Give every ``Linear`` of ``model`` (and any module with a ``small`` slot and a ``weight``,
    the output layer: ``head_rows``, as it only ever sees one row per request) a ``SmallBatchGemm``,
    on a CPU, fp32 or natively bf16 (``packs``), single-process model whose weights fit
    ``PACK_BUDGET_BYTES``. Returns the bytes packed (0: nothing packed)."""
    targets = [
        m for m in model.modules() if hasattr(m, "small") and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    size = sum(m.weight.numel() * m.weight.element_size() for m in targets)
    if not targets or size > PACK_BUDGET_BYTES or any(getattr(m, "tp", SINGLE).size > 1 for m in targets):
        return 0
    packed = 0
    for m in targets:
        m.small = SmallBatchGemm.make(m.weight, m.bias, SMALL_BATCH_ROWS if isinstance(m, Linear) else head_rows)
        if m.small is not None:
            packed += m.weight.numel() * m.weight.element_size()
    return packed


class RMSNorm(nn.Module):
    """x / rms(x) * weight (``TorchOps.rms_norm``); ``add_norm`` fuses the residual add before it."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)
        self.ops = ops_for(device)

    def forward(self, x: torch.Tensor, quantize: bool = False) -> torch.Tensor | QuantizedRows:
        """``quantize``: the next layer takes ``QuantizedRows`` (``Linear.takes_quantized_rows``); where
        it would quantise these rows itself (``ops.quantizes_rows``), the norm's kernel does it."""
        if quantize and self.ops.quantizes_rows(x.shape[0]):
            return self.ops.rms_norm_fp8(x, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, quantize: bool = False
    ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add and the norm after it, one kernel on CUDA.
        The sum is rounded to the model dtype before the norm, as the unfused model has it.
        ``quantize`` as in ``forward``."""
        if quantize and self.ops.quantizes_rows(x.shape[0]):
            return self.ops.add_rms_norm_fp8(x, residual, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    """(x - mean) / std * weight + bias over the last dim: F.layer_norm, as
    transformers' nn.LayerNorm (the statistics are fp32 inside on CUDA too)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = empty_param(hidden_size, dtype=dtype, device=device)
        self.bias = empty_param(hidden_size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused in one matmul: rows [gate; up].
    Tensor parallel: each rank holds its I/N columns of gate and of up, and of down's inputs."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        tp.part(intermediate_size, "intermediate_size")  # gate and up split alike
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias, dtype, device, tp, "column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device, tp, "row")
        self.ops = ops_for(device)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        h = self.gate_up_proj(x)  # [T, 2I]
        if self.down_proj.takes_quantized_rows and self.ops.quantizes_rows(h.shape[0]):
            return self.down_proj(self.ops.silu_and_mul_fp8(h))  # quantised in the same kernel
        return self.down_proj(self.ops.silu_and_mul(h))  # [T, I] -> [T, H]


def rope_parameters(config) -> dict:
    """The rope settings as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older versions
    in ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict
    (whose type key was once ``type``).
    """
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        params = {"rope_theta": getattr(config, "rope_theta", 10000.0), **(getattr(config, "rope_scaling", None) or {})}
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def rope_inv_freq(config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] (fp32, CPU) and the cos/sin scale factor."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    # "dynamic" and "longrope" change with the sequence length: not supported.
    if rope_type in ("linear", "llama3", "yarn"):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        return inv_freq.float().cpu(), float(scaling)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, linear, llama3, yarn are)")


class Rotary(nn.Module):
    """cos/sin tables for given positions; HF Llama's rotate-half convention."""

    def __init__(self, config, head_dim: int, device: torch.device | str):
        super().__init__()
        inv_freq, self.scaling = rope_inv_freq(config, head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in ``dtype`` (broadcast over heads)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2], fp32 as HF
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes [num_heads] fp32 (Press et al.; BLOOM's exact values).

    For a power of two n: 2^(-8/n), 2^(-16/n), ... For other n, the slopes
    of the next lower power of two, then every other slope of twice that.
    """
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / closest) for i in range(1, closest + 1)]
    extra = [2.0 ** (-4.0 * i / closest) for i in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes + extra, dtype=torch.float32)
