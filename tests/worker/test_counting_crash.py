"""The counting stand-in's fault injection (``--counting_raise_token``, ``--counting_exit_token``):
off by default; when set, a forward whose input holds the token raises, or ends the process at once
(tests/integration/test_poison_request.py uses both against ``lightq serve``)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from worker.main import load_model_or_stand_in
from worker.model.counting_model import CRASH_EXIT_CODE, InjectedCrash


def stand_in(**settings):
    config = WorkerSettings(model=ModelSettings(model_dir="counting"), **settings)
    return load_model_or_stand_in(config, None, torch.float32, torch.device("cpu"))[0]


def batch(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(input_ids=torch.tensor(ids), output_index=torch.tensor([len(ids) - 1]))


def test_off_by_default_and_on_only_for_its_token():
    assert stand_in().forward(batch(7, 4090, 49000)).argmax(-1).tolist() == [49001 % 4096]
    model = stand_in(counting_raise_token=49000)
    assert model.forward(batch(7, 8)).argmax(-1).tolist() == [9]
    with pytest.raises(InjectedCrash, match="49000"):
        model.forward(batch(7, 49000, 8))


def test_the_exit_token_ends_the_process_at_once():
    code = (
        "import torch\n"
        "from tests.worker.test_counting_crash import batch, stand_in\n"
        "model = stand_in(counting_exit_token=49001)\n"
        "model.forward(batch(1, 2))\n"
        "print('survived the first', flush=True)\n"
        "try:\n"
        "    model.forward(batch(49001))\n"
        "finally:\n"
        "    print('a finally ran', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == CRASH_EXIT_CODE, done.stderr
    assert done.stdout == "survived the first\n"  # no clean-up ran: not even a finally
    assert "told to exit on token 49001" in done.stderr
