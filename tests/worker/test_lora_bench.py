"""bench.engine.offline's LoRA mode on a CPU: bench.engine.lora_adapters writes adapters the worker
loads as PEFT's, and every request of a run carries one of them (its output differs from the base
model's)."""

from __future__ import annotations

import numpy as np

from bench.engine import offline
from bench.engine.lora_adapters import register_many, write_adapters
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


def test_many_registered_adapters_over_few_files_and_slots_answer_as_their_files(tmp_path):
    """--lora-resident: six run-time adapters over two files, at most two on the device, twelve requests
    at once: each request's tokens are those of its adapter's file served from a slot of its own
    (--lora_modules), and the adapters were paged in and out (more loads than slots)."""
    loras = write_adapters("tiny", 2, 4, tmp_path)
    rng = np.random.default_rng(0)
    work = [(rng.integers(3, 500, size=n).tolist(), 6) for n in rng.integers(4, 40, size=12)]
    settings = offline.WorkerSettings(
        model=offline.ModelSettings(model_dir=f"dummy:{config_dir('tiny')}", max_req_total_len=256, max_lora_rank=4),
        device="cpu",
        max_total_token_num=4096,
        batch_max_tokens=64,
        max_loras=2,
    )
    engine = offline.build_engine(settings)
    names = register_many(engine.runner.adapters, engine.runner.model, loras, 6, 4)
    tally = offline.Tally(keep_ids=True)
    offline.drive(engine, work, progress=False, tally=tally, adapters=names)
    assert tally.tokens == 12 * 6 and engine.runner.adapters.loads > 2
    profiled = offline.Tally(keep_ids=True)  # --profile-prefills: the same tokens, steps that started some kept
    profiles = offline.PrefillProfiles(2, after=0)
    again = offline.build_engine(settings)
    register_many(again.runner.adapters, again.runner.model, loras, 6, 4)
    offline.drive(again, work, progress=False, tally=profiled, adapters=names, profiles=profiles)
    assert (
        profiled.output_ids == tally.output_ids and len(profiles.kept) == 2 and all(n > 0 for _, n, _ in profiles.kept)
    )

    draw = np.random.default_rng(1)  # drive's draw: request i's adapter, hence its file
    files = [f"a{int(names[draw.integers(len(names))][1:]) % 2}" for _ in work]
    assert set(files) == {"a0", "a1"}
    static = offline.Tally(keep_ids=True)
    for i, (item, file) in enumerate(zip(work, files, strict=True)):
        one = offline.Tally(keep_ids=True)
        offline.drive(engine_with(loras), [item], progress=False, tally=one, adapters=[file])
        static.output_ids[f"r{i}"] = one.output_ids["r0"]
    assert tally.output_ids == static.output_ids
