"""``--eos_id`` (LightLLM's flag) replaces the model's end-of-sequence ids in the engine."""

from __future__ import annotations

from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from worker.main import build_engine


def test_eos_id_replaces_the_models_and_tokenizers():
    model = ModelSettings(model_dir="counting")
    default = build_engine(WorkerSettings(model=model, device="cpu", max_total_token_num=256), tokenizer=None)
    assert default.eos_ids == set()  # the stand-in has none of its own
    given = build_engine(
        WorkerSettings(model=model, device="cpu", max_total_token_num=256, eos_id=[7, 9]), tokenizer=None
    )
    assert given.eos_ids == {7, 9}
