"""GPTQ's FP8 rounding (``worker.model.gptq``) and ``lightq quantize``'s checkpoints.

GPTQ must lower the layer's output error below round-to-nearest's on correlated inputs (what it is
for) while keeping round-to-nearest's per-channel scales; ``lightq quantize`` must write a checkpoint
lightq loads as W8A16 whose logits are transformers' on the checkpoint's own dequantised weights.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file

from lightq.cli import main as lightq_main
from shared.model_files import ModelSource
from tests.worker.model_harness import PoolRunner
from tests.worker.test_fp8 import (
    assert_fp8_match,
    fake_quantized,
    last_logits,
    prompts,
    quantization_config,
    reference,
)
from worker.model.fp8 import Fp8Linear
from worker.model.fp8_checkpoint import checkpoint_format
from worker.model.gptq import gptq_fp8, output_error
from worker.model.loader import load_model
from worker.model.quant import FP8, dequantize_rows, quantize_rows


def correlated_gram(k: int, seed: int = 0) -> torch.Tensor:
    """X^T X / n of inputs whose channels are mixed and a few much larger (as real activations are)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4000, k, generator=gen) @ torch.randn(k, k, generator=gen) * 0.3 + torch.randn(
        4000, k, generator=gen
    )
    x[:, :4] *= 20
    return x.T @ x / len(x)


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_rounds_to_fp8_with_round_to_nearest_scales_and_a_smaller_output_error(act_order):
    torch.manual_seed(1)
    weight, gram = torch.randn(48, 96), correlated_gram(96)
    codes, scale = gptq_fp8(weight, gram, block=32, act_order=act_order)
    nearest, nearest_scale = quantize_rows(weight)
    assert codes.dtype == FP8 and codes.shape == weight.shape
    assert torch.equal(scale, nearest_scale)
    assert not torch.equal(codes.view(torch.uint8), nearest.view(torch.uint8))  # it did choose other values
    gptq_error = output_error(weight, dequantize_rows(codes, scale), gram)
    nearest_error = output_error(weight, dequantize_rows(nearest, nearest_scale), gram)
    assert gptq_error < 0.7 * nearest_error, f"GPTQ {gptq_error:.4g} against round-to-nearest {nearest_error:.4g}"


def test_gptq_rounds_weights_of_inputs_never_seen_to_zero():
    weight, gram = torch.randn(16, 32), correlated_gram(32)
    gram[5, :], gram[:, 5] = 0.0, 0.0
    codes, scale = gptq_fp8(weight, gram)
    assert torch.all(codes[:, 5].float() == 0)
    assert torch.isfinite(dequantize_rows(codes, scale)).all()


def test_lightq_quantize_writes_a_checkpoint_lightq_runs_as_w8a16(tmp_path):
    source, out = tmp_path / "source", tmp_path / "fp8"
    ref = reference("llama-bias", source)
    command = [sys.executable, "-m", "lightq.cli", "quantize", "--model_dir", str(source), "--out", str(out)]
    done = subprocess.run(
        [*command, "--seqs", "4", "--seq_len", "32", "--device", "cpu"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "W8A16" in done.stdout
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized" and config["config_groups"]["group_0"]["input_activations"] is None
    tensors = load_file(str(out / "model.safetensors"))
    names = [n for n in tensors if n.endswith("_proj.weight")]
    assert len(names) == 7 * 2 and all(tensors[n].dtype == FP8 for n in names)  # q k v o gate up down, 2 blocks
    weights = {n.removesuffix(".weight"): dequantize_rows(tensors[n], tensors[f"{n}_scale"][:, 0]) for n in names}

    model, _ = load_model(ModelSource("hf", str(out)), torch.float32, "cpu")  # --quantization none: the config's
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2 and not any(m.quantize_inputs for m in layers)
    ids = prompts(ref.config.vocab_size)
    got = PoolRunner(model).step(dict(enumerate(ids)))
    assert_fp8_match(got, last_logits(fake_quantized(ref, weights, inputs=False), ids), last_logits(ref, ids))
    # GPTQ chose other values than rounding each weight to nearest (the calibration text mattered)
    nearest = quantize_rows(ref.model.layers[0].mlp.down_proj.weight.detach())[0]
    assert not torch.equal(nearest.view(torch.uint8), tensors["model.layers.0.mlp.down_proj.weight"].view(torch.uint8))


def test_lightq_quantize_refuses_an_existing_folder_and_random_weights(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        lightq_main(["quantize", "--model_dir", "default", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "exists" in capsys.readouterr().err
    reference("llama-bias", tmp_path / "config")
    with pytest.raises(SystemExit) as exit_info:
        lightq_main(["quantize", "--model_dir", f"dummy:{tmp_path / 'config'}", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "no weights to quantise" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout, inputs, weights_only",
    [("ct-channel", True, False), ("ct-channel", False, True), ("fp8-tensor", True, False)],
)
def test_a_checkpoint_is_weights_only_when_no_group_quantises_inputs(layout, inputs, weights_only):
    """compressed-tensors without ``input_activations`` (what ``lightq quantize`` writes) runs W8A16; one
    with them, or HF's ``fp8`` method (always with an activation scheme), runs W8A8."""
    config = quantization_config(layout)
    if not inputs:
        config["config_groups"]["group_0"]["input_activations"] = None
    fmt = checkpoint_format(transformers.PretrainedConfig(quantization_config=config))
    assert fmt is not None and fmt.weights_only == weights_only
