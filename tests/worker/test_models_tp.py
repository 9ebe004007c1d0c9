"""Tensor parallelism on CPU: 2 processes over gloo give the logits of one process.

Each architecture's tiny checkpoint (random norms and biases, so the
replicated and the split biases both count) is run by a single process
(tp 1, checked against transformers elsewhere) and by a group of two, which
splits heads, MLP columns and the vocabulary and all-reduces / all-gathers
through torch.distributed. Both drive the same pool steps: a packed prefill,
a chunked prefill beside a decode, and decode steps.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from shared.model_files import ModelSource
from tests.worker.model_harness import PoolRunner
from worker.model.layers import TensorParallel
from worker.model.loader import load_model
from worker.model.models.llama import LlamaForCausalLM

TP = 2
LLAMA_LIKE = dict(
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
    # Row-parallel biases (o_proj, down_proj) are whole on each rank and added once.
    "llama-gqa-bias": (
        transformers.LlamaConfig,
        "LlamaForCausalLM",
        dict(LLAMA_LIKE, attention_bias=True, mlp_bias=True),
    ),
    "qwen2-tied": (transformers.Qwen2Config, "Qwen2ForCausalLM", dict(LLAMA_LIKE, tie_word_embeddings=True)),
    "mistral-window": (transformers.MistralConfig, "MistralForCausalLM", dict(LLAMA_LIKE, sliding_window=4)),
    "bloom": (
        transformers.BloomConfig,
        "BloomForCausalLM",
        dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256, layer_norm_epsilon=1e-5),
    ),
}
STEPS = [  # request id -> new tokens, per pool step
    {0: [5, 17, 3, 99, 42, 7], 1: [250], 2: list(range(30, 41))},
    {0: [8], 1: [9, 10, 11, 12, 13, 14, 15], 2: [1]},  # request 1: a chunk after its first token
    {0: [60], 1: [61], 2: [62]},
    {0: [70], 1: [71], 2: [72]},
]


def _save_checkpoints(folder) -> dict[str, str]:
    paths = {}
    for name, (config_cls, arch, kw) in CONFIGS.items():
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(config_cls(**kw, architectures=[arch]))
        with torch.no_grad():
            for p in ref.parameters():
                if p.dim() == 1:  # norms and biases init to 1 and 0: make them count
                    p.add_(0.1 * torch.randn_like(p))
        paths[name] = str(folder / name)
        ref.save_pretrained(paths[name])
    return paths


def _run(path: str, tp: TensorParallel) -> list[torch.Tensor]:
    """Logits [B, vocab] of every step of STEPS."""
    model, _ = load_model(ModelSource("hf", path), torch.float32, "cpu", tp=tp)
    runner = PoolRunner(model)
    return [runner.step(step) for step in STEPS]


def _rank_main(rank: int, init_file: str, paths: dict[str, str], out_dir: str) -> None:
    """One process of the group: every architecture; rank r saves its logits for the parent."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        tp = TensorParallel(rank, TP)
        results = {name: _run(path, tp) for name, path in paths.items()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def group_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    paths = _save_checkpoints(folder)
    mp.spawn(_rank_main, args=(str(folder / "init"), paths, str(folder)), nprocs=TP, join=True)
    return paths, [torch.load(folder / f"rank{r}.pt") for r in range(TP)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tp2_matches_tp1(name, group_results):
    paths, per_rank = group_results
    single = _run(paths[name], TensorParallel())
    for rank, results in enumerate(per_rank):
        for step, (got, want) in enumerate(zip(results[name], single)):
            scale = want.abs().max().item()
            # Only the summation order differs (partial sums across ranks).
            torch.testing.assert_close(
                got,
                want,
                atol=1e-5 * max(scale, 1.0),
                rtol=1e-5,
                msg=lambda m, rank=rank, step=step: f"rank {rank}, step {step}: {m}",
            )


def test_split_must_divide():
    config = transformers.LlamaConfig(**dict(LLAMA_LIKE, num_key_value_heads=1))  # 1 KV head cannot split in 2
    with pytest.raises(ValueError, match="key-value heads"):
        LlamaForCausalLM(config, torch.float32, "meta", tp=TensorParallel(0, TP))
