"""bench.engine.offline's LoRA mode on a CPU: bench.engine.lora_adapters writes adapters the worker
loads as PEFT's, and every request of a run carries one of them (its output differs from the base
model's)."""

from __future__ import annotations

import numpy as np

from bench.engine import offline
from bench.engine.lora_adapters import write_adapters
from bench.engine.shapes import config_dir


def engine_with(loras: list[str]):
    settings = offline.WorkerSettings(
        model=offline.ModelSettings(model_dir=f"dummy:{config_dir('tiny')}", max_req_total_len=256, lora_modules=loras),
        device="cpu",
        max_total_token_num=4096,
        batch_max_tokens=64,
    )
    return offline.build_engine(settings)


def test_offline_serves_the_written_adapters(tmp_path):
    loras = write_adapters("tiny", 2, 4, tmp_path)
    assert write_adapters("tiny", 2, 4, tmp_path) == loras  # kept, not written again
    rng = np.random.default_rng(0)
    work = [(rng.integers(3, 500, size=n).tolist(), 6) for n in (12, 30, 5, 21)]
    outputs = []
    for engine, adapters in ((engine_with([]), None), (engine_with(loras), ["a0", "a1"])):
        assert engine.runner.adapters is None or engine.runner.adapters.names == ["a0", "a1"]
        tally = offline.Tally(keep_ids=True)
        offline.drive(engine, work, progress=False, tally=tally, adapters=adapters)
        assert tally.tokens == 4 * 6
        outputs.append(tally.output_ids)
    assert outputs[0] != outputs[1]  # the adapters' deltas are real work
