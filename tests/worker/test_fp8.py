"""FP8 models on the CPU path: quantised at load, pre-quantised checkpoints in both published layouts,
and the FP8 KV pool, each against transformers on the same weights.

The reference is transformers' own model with the FP8 arithmetic put into it: every linear layer but
the output layer computes x' W'^T with W' the weight lightq holds, dequantised, and x' its input
quantised per token and dequantised (``worker.model.ops.quantize_rows``). lightq's FP8 model must match
that reference far more closely than it matches the full-precision model (a misplaced or missing scale
gives errors as large as FP8's own error, or larger): the FP8 error is ~1e-2 of the logits here, the
match ~1e-7, and the test allows a quarter of the former, room for a rare value rounding to the next
FP8 step on one side only.
"""

from __future__ import annotations

import copy
import glob
import json
import os

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from shared.model_files import ModelSource
from shared.worker_settings import WorkerSettings
from tests.worker.model_harness import PoolRunner
from worker.main import pool_size
from worker.model import fp8
from worker.model.attention import TorchAttention
from worker.model.fp8 import Fp8Linear
from worker.model.kv_cache import KVCache, kv_storage_dtype
from worker.model.loader import load_model
from worker.model.quant import FP8, dequantize_rows, quantize_rows

LLAMA = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
CONFIGS = {
    "llama-bias": (transformers.LlamaConfig, "LlamaForCausalLM", dict(LLAMA, attention_bias=True, mlp_bias=True)),
    "qwen2-tied": (transformers.Qwen2Config, "Qwen2ForCausalLM", dict(LLAMA, tie_word_embeddings=True)),
    "bloom": (
        transformers.BloomConfig,
        "BloomForCausalLM",
        dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256, layer_norm_epsilon=1e-5),
    ),
}
PROMPT_LENS = (5, 11, 1, 8)


def reference(name: str, folder) -> transformers.PreTrainedModel:
    """A seeded transformers model (norms and biases randomised so they count), saved to ``folder``."""
    config_cls, arch, kw = CONFIGS[name]
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config_cls(**kw, architectures=[arch])).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    ref.config._attn_implementation = "eager"
    ref.save_pretrained(folder)
    return ref


def fake_quantized(
    ref, weights: dict[str, torch.Tensor] | None = None, inputs: bool = True
) -> transformers.PreTrainedModel:
    """``ref`` computing as lightq's FP8 layers do: each linear layer but the output layer's weight
    replaced by ``weights[name]`` (default: its own, quantised per output channel and dequantised) and
    its input quantised per token (``inputs``; else taken as it comes: W8A16)."""
    fake = copy.deepcopy(ref)
    for name, m in fake.named_modules():
        if not isinstance(m, torch.nn.Linear) or "lm_head" in name:
            continue
        with torch.no_grad():
            m.weight.copy_(weights[name] if weights else dequantize_rows(*quantize_rows(m.weight)))

        def forward(x, m=m):
            if not inputs:
                return F.linear(x, m.weight, m.bias)
            flat = x.reshape(-1, x.shape[-1])
            return F.linear(dequantize_rows(*quantize_rows(flat)).view(x.shape), m.weight, m.bias)

        m.forward = forward
    return fake


@torch.no_grad()
def last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    return torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def assert_fp8_match(got: torch.Tensor, fake: torch.Tensor, full: torch.Tensor) -> None:
    """got matches the FP8 reference (fake) to far better than FP8's own error (against full)."""
    fp8_error = (fake - full).abs().max().item()
    assert fp8_error > 1e-4, "the reference is not quantised"
    error = (got - fake).abs().max().item()
    assert error < 0.25 * fp8_error, f"FP8 model off its reference by {error:.3g}; FP8 itself moves {fp8_error:.3g}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quantised_at_load_matches_fake_quantised_transformers(name, tmp_path):
    ref = reference(name, tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu", quantization="fp8")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2 and all(m.weight.dtype == FP8 for m in layers)  # 4 linear layers a block
    ids = prompts(ref.config.vocab_size)
    runner = PoolRunner(model)
    got = runner.step(dict(enumerate(ids)))  # a packed prefill
    assert_fp8_match(got, last_logits(fake_quantized(ref), ids), last_logits(ref, ids))
    # decode steps: one new token each, the K/V of the prefill read back from the pool
    new = [7, 8, 9, 10]
    got = runner.step({b: [t] for b, t in enumerate(new)})
    longer = [p + [t] for p, t in zip(ids, new)]
    assert_fp8_match(got, last_logits(fake_quantized(ref), longer), last_logits(ref, longer))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_only_fp8_matches_transformers_with_fp8_weights_and_full_inputs(name, tmp_path):
    """--quantization fp8_w8a16: the same FP8 weights, the inputs as they come. Prefill and decode match
    transformers with the dequantised weights and unquantised inputs, and that reference, not W8A8's."""
    ref = reference(name, tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu", quantization="fp8_w8a16")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2 and not any(m.quantize_inputs for m in layers)
    ids, new = prompts(ref.config.vocab_size), [7, 8, 9, 10]
    runner = PoolRunner(model)
    prefill = runner.step(dict(enumerate(ids)))
    decode = runner.step({b: [t] for b, t in enumerate(new)})  # the prefill's K/V read back from the pool
    for got, seqs in ((prefill, ids), (decode, [p + [t] for p, t in zip(ids, new)])):
        w8a16, w8a8 = last_logits(fake_quantized(ref, inputs=False), seqs), last_logits(fake_quantized(ref), seqs)
        assert_fp8_match(got, w8a16, last_logits(ref, seqs))
        assert (got - w8a16).abs().max() < 0.25 * (got - w8a8).abs().max()  # the inputs were not quantised


# --- pre-quantised checkpoints -------------------------------------------------------------------------


def quantization_config(layout: str) -> dict:
    if layout.startswith("fp8"):
        config = {"quant_method": "fp8", "activation_scheme": "static" if layout == "fp8-tensor" else "dynamic"}
        return {**config, "weight_block_size": [32, 32]} if layout == "fp8-block" else config
    strategy = layout.removeprefix("ct-")
    group = {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def quantize_as_published(layout: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """One linear layer's tensors as the layout stores them (suffix -> tensor)."""
    if layout == "fp8-block":  # [32, 32] blocks, scale_inv [ceil(out/32), ceil(in/32)]
        out_f, in_f = weight.shape
        padded = F.pad(weight, (0, -in_f % 32, 0, -out_f % 32))
        blocks = padded.view(padded.shape[0] // 32, 32, padded.shape[1] // 32, 32)
        scale = blocks.abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[:out_f, :in_f]
        return {"weight": (weight / full).to(FP8), "weight_scale_inv": scale}
    if layout == "ct-channel":
        q, scale = quantize_rows(weight)
        return {"weight": q, "weight_scale": scale[:, None]}
    scale = weight.abs().max() / 448  # per tensor: [] for the fp8 method, [1] for compressed-tensors
    tensors = {"weight": (weight / scale).to(FP8), "weight_scale": scale if layout.startswith("fp8") else scale[None]}
    if layout == "fp8-tensor":
        tensors["input_scale"] = torch.tensor(0.05)  # static activation scales: dropped
    return tensors


def dequantized(layout: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """What lightq holds for the layer, in full precision: the published values exactly, except that
    block-scaled weights are requantised per output channel at load."""
    if layout == "fp8-block":
        scale = tensors["weight_scale_inv"]
        w = (
            tensors["weight"].float()
            * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[
                : tensors["weight"].shape[0], : tensors["weight"].shape[1]
            ]
        )
        return dequantize_rows(*quantize_rows(w))
    return tensors["weight"].float() * tensors["weight_scale"].reshape(-1, 1)


def save_prequantised(ref, layout: str, folder, unquantised: str) -> dict[str, torch.Tensor]:
    """``ref``'s checkpoint in ``layout`` (every linear layer but the output layer and ``unquantised``,
    which stays full precision as an ignored layer does); returns each layer's weight as lightq holds it."""
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        os.remove(path)
    state = {
        k: v.contiguous()
        for k, v in ref.state_dict().items()
        if k != "lm_head.weight" or not ref.config.tie_word_embeddings
    }
    holds = {}
    for name, m in ref.named_modules():
        if not isinstance(m, torch.nn.Linear) or "lm_head" in name or name == unquantised:
            continue
        tensors = quantize_as_published(layout, m.weight.detach())
        state.update({f"{name}.{suffix}": t for suffix, t in tensors.items()})
        holds[name] = dequantized(layout, tensors)
    save_file(state, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(layout)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return holds


@pytest.mark.parametrize("layout", ["fp8-tensor", "fp8-block", "ct-channel", "ct-tensor"])
def test_prequantised_checkpoint_loads_as_published(layout, tmp_path):
    ref = reference("llama-bias", tmp_path)
    # q_proj of layer 0 left in full precision: its fused qkv_proj is FP8, q's rows quantised at load
    unquantised = "model.layers.0.self_attn.q_proj"
    holds = save_prequantised(ref, layout, tmp_path, unquantised)
    holds[unquantised] = dequantize_rows(*quantize_rows(ref.get_submodule(unquantised).weight.detach()))
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu")  # no --quantization needed
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 8
    ids = prompts(ref.config.vocab_size)
    got = PoolRunner(model).step(dict(enumerate(ids)))
    assert_fp8_match(got, last_logits(fake_quantized(ref, holds), ids), last_logits(ref, ids))


def test_quantisation_configs_lightq_does_not_load_are_named(tmp_path):
    reference("llama-bias", tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    for qc, match in [
        ({"quant_method": "gptq", "bits": 4}, "FP8 checkpoints only"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "float-quantized"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
    ]:
        with open(tmp_path / "config.json", "w") as f:
            json.dump({**config, "quantization_config": qc}, f)
        with pytest.raises(ValueError, match=match):
            load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu")


# --- the FP8 KV pool -----------------------------------------------------------------------------------


def test_fp8_pool_stores_what_quantize_rows_gives_and_reads_it_back_scaled():
    cache = KVCache(2, 10, 2, 16, FP8, "cpu")
    kv = torch.randn(3, 4, 16) * torch.tensor([1e-3, 1.0, 30.0, 0.0])[None, :, None]  # per head: tiny to zero
    slots = torch.tensor([7, 0, 4])
    cache.store(1, slots, kv)
    q, scale = quantize_rows(kv)
    assert torch.equal(cache.buffer[1][slots].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(cache.scales[1][slots], scale)
    back = cache.read(1, slots)
    torch.testing.assert_close(back, q.float() * scale[..., None])
    torch.testing.assert_close(back, kv, atol=0.07 * kv.abs().amax(-1, keepdim=True).max().item(), rtol=0.07)
    assert not cache.buffer[0].float().any() and not cache.scales[0].any()  # the other layer untouched


def test_fp8_pool_holds_at_least_1_9x_the_tokens(monkeypatch):
    """Llama-3-8B's KV shape on a faked 80 GiB card: the same --mem_fraction, FP8 against bf16."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))

    class Model(torch.nn.Module):
        num_layers, num_kv_heads, head_dim, dtype = 32, 8, 128, torch.bfloat16

    sizes = {
        kv: pool_size(WorkerSettings(kv_cache_dtype=kv), Model(), torch.device("cuda")) for kv in ("auto", "fp8_e4m3")
    }
    assert sizes["fp8_e4m3"] >= 1.9 * sizes["auto"]
    assert KVCache.bytes_per_token(32, 8, 128, FP8) == 32 * 2 * 8 * (128 + 4)
    assert kv_storage_dtype(torch.bfloat16, "auto") == torch.bfloat16


def pool_runner(model, kv_dtype: torch.dtype) -> PoolRunner:
    """``PoolRunner`` with its pool in ``kv_dtype``."""
    runner = PoolRunner(model)
    runner.cache = KVCache(model.num_layers, 512, model.num_kv_heads, model.head_dim, kv_dtype, "cpu")
    model.set_backend(TorchAttention(runner.cache))
    return runner


@pytest.mark.parametrize("name", ["llama-bias", "bloom"])
def test_fp8_weights_and_kv_pool_stay_near_the_full_precision_model(name, tmp_path):
    """Weights and pool in FP8: prefill then decode steps read quantised K/V. Near the fp32 model (within
    FP8's error), and not equal to the FP8-weights model with a full-precision pool (the pool is FP8)."""
    ref = reference(name, tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu", quantization="fp8")
    ids = prompts(ref.config.vocab_size)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        runner = pool_runner(model, kv_storage_dtype(torch.float32, kv))
        runs[kv] = [runner.step(dict(enumerate(ids)))] + [runner.step({b: [t] for b in range(4)}) for t in (3, 4)]
    full = last_logits(ref, ids)
    scale = full.abs().max().item()
    for got, fp8_weights in zip(runs["fp8_e4m3"], runs["auto"]):
        assert (got - fp8_weights).abs().max() > 0  # the pool's quantisation is there
        torch.testing.assert_close(got, fp8_weights, atol=0.05 * scale, rtol=0.05)


def test_the_norms_and_silu_quantise_for_the_fp8_linears_after_them(monkeypatch, tmp_path):
    """Each block's two norms and its SiLU-and-mul hand their FP8 linear rows already quantised
    (``QuantizedRows``; o_proj's input, attention's output, is quantised by the linear itself), and the
    logits are those of the model that quantises in the linears: prefill and decode, bit for bit."""
    ref = reference("llama-bias", tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu", quantization="fp8")
    ids = prompts(ref.config.vocab_size)
    seen: list[str] = []
    forward = Fp8Linear.forward

    def spy(self, x):
        seen.append(type(x).__name__)
        return forward(self, x)

    def run() -> list[torch.Tensor]:
        runner = PoolRunner(model)
        return [runner.step(dict(enumerate(ids))), runner.step({b: [t] for b, t in enumerate([7, 8, 9, 10])})]

    monkeypatch.setattr(Fp8Linear, "forward", spy)
    fused = run()
    # per block: qkv, o, gate_up, down; 2 blocks, 2 steps
    assert seen == ["QuantizedRows", "Tensor", "QuantizedRows", "QuantizedRows"] * 4
    monkeypatch.setattr(Fp8Linear, "takes_quantized_rows", property(lambda self: False))
    seen.clear()
    unfused = run()
    assert seen == ["Tensor"] * 16
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_fp8_on_a_gpu_without_fp8_is_refused_at_start(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match="compute capability 8.9 or later.*is 8.0"):
        fp8.check_device("cuda", "FP8 weights")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_device("cuda:0", "FP8 weights")  # an H100 / H200
    fp8.check_device("cpu", "FP8 weights")  # the reference path runs anywhere
