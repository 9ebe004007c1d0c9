"""The counting stand-in: next token = last + 1, and with ``--counting_step_ms`` each forward also
waits that long, as a host waits on a device's step (time.sleep observed, not timed)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from worker.main import load_model_or_stand_in
from worker.model import counting_model


def batch(*last_tokens: int) -> SimpleNamespace:
    ids = torch.tensor([7, *last_tokens])
    return SimpleNamespace(input_ids=ids, output_index=torch.arange(1, len(ids)))


def test_each_forward_waits_the_step_time_and_counts_on(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(counting_model.time, "sleep", waits.append)
    settings = WorkerSettings(model=ModelSettings(model_dir="counting"), counting_step_ms=20)
    model, config = load_model_or_stand_in(settings, None, torch.float32, torch.device("cpu"))
    logits = model.forward(batch(3, 4094))
    assert logits.argmax(-1).tolist() == [4, 4095] and config.vocab_size == logits.shape[1]
    model.forward(batch(5))
    assert waits == [0.02, 0.02]


def test_without_a_step_time_nothing_waits(monkeypatch):
    monkeypatch.setattr(counting_model.time, "sleep", lambda s: (_ for _ in ()).throw(AssertionError(s)))
    model, _ = load_model_or_stand_in(
        WorkerSettings(model=ModelSettings(model_dir="counting")), None, torch.float32, torch.device("cpu")
    )
    assert model.forward(batch(1)).argmax(-1).tolist() == [2]
