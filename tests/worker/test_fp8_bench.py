"""The FP8 benchmarks' CPU modes: bench.engine.fp8_accuracy's smoke run, bench.engine.offline with FP8 weights and
an FP8 pool on the tiny shape, and bench.engine.decode_step's random FP8 pool."""

from __future__ import annotations

import math

import numpy as np
import torch

from bench.engine import decode_step, fp8_accuracy, offline
from bench.engine.shapes import config_dir
from worker.model.kv_cache import KVCache
from worker.model.quant import FP8


def test_accuracy_smoke_run_scores_every_arm(capsys):
    results = fp8_accuracy.main(["--smoke", "--device", "cpu"])
    tallies = results["tiny"]
    ref = tallies["reference"]
    assert ref.positions == 8 * 47 and ref.kl == 0 and ref.top1 == ref.positions
    assert ref.greedy_same == ref.greedy_total == 8 * 8 and ref.identical == 8
    assert ref.forced_same == ref.greedy_total  # the reference picks its own greedy tokens
    ref_ppl = math.exp(ref.nll / ref.positions)
    for arm in fp8_accuracy.ARMS[1:]:
        t = tallies[arm]
        assert 0 < t.kl / t.positions < 1e-3  # quantised, and near: a random model's flat distributions
        assert abs(math.exp(t.nll / t.positions) / ref_ppl - 1) < 0.01
        assert 0.5 < t.top1 / t.positions < 1 and 0.5 < t.forced_same / t.greedy_total <= 1
    out = capsys.readouterr().out
    assert "fp8_accuracy tiny (random weights): fp8 weights: ppl" in out and "fp8 weights + kv" in out


def test_offline_runs_fp8_weights_and_pool(capsys):
    args = offline.parse_args(
        ["--model-shape", "tiny", "--device", "cpu", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]
    )
    settings = offline.WorkerSettings(
        model=offline.ModelSettings(model_dir=f"dummy:{config_dir('tiny')}", max_req_total_len=256),
        device="cpu",
        max_total_token_num=4096,
        batch_max_tokens=32,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = offline.build_engine(settings)
    assert engine.runner.model.backend.cache.buffer.dtype == FP8
    rng = np.random.default_rng(0)
    work = [(rng.integers(3, 500, size=n).tolist(), o) for n, o in [(40, 3), (5, 9), (70, 1)]]
    tally = offline.Tally()
    assert offline.drive(engine, work, progress=False, tally=tally) > 0
    assert tally.tokens == 3 + 9 + 1


def test_decode_step_fills_an_fp8_pool_with_quantised_noise():
    cache = KVCache(2, 100, 2, 16, FP8, "cpu")
    decode_step.fill_random(cache)
    values = cache.buffer.float() * cache.scales[..., None]
    assert values.std().item() > 0.5 and (cache.scales > 0).all()
    assert cache.buffer.float().abs().amax(-1).eq(448).all()  # every head's largest value on 448
    full = KVCache(1, 10, 1, 16, torch.float32, "cpu")
    decode_step.fill_random(full)
    assert full.buffer.std().item() > 0.5
