"""A page-in's job table kept on the device (``worker.lora.page_tables``): kept tables write what
fresh ones write, and a slot's later tables start from what the kept one left there (the ranks a
smaller adapter zeroes). Triton's interpreter on a CPU (tests/worker/test_lora_gpu.py: the page-ins
on a GPU)."""

from __future__ import annotations

import dataclasses

import torch

from shared.model_files import ModelSource
from tests.worker.test_engine import tiny  # noqa: F401 (fixture)
from tests.worker.test_lora import adapters  # noqa: F401 (fixture)
from worker.lora.adapter import load_adapter
from worker.lora.adapter_set import AdapterSet
from worker.model.loader import load_model

MAX_RANK = 16


def test_kept_tables_write_what_the_copies_write(tiny, adapters):  # noqa: F811
    """Adapters of other layouts into one slot in a cycle, twice (kept tables serve the second round),
    then a new layout (its table built after kept ones wrote the slot: it must zero what the last
    one, not the last built one, left): each page-in leaves the slot as the plain copies do."""
    folders, _ = adapters
    order = ["k2", "all16", "mlp8", "k2", "all16", "mlp8", "qv4"]
    sets = []
    for staging in (False, True):
        model, _ = load_model(ModelSource("hf", tiny[1]), torch.float32, "cpu")
        lora = AdapterSet([], spare=1, rank=MAX_RANK)
        lora.install(model, staging=staging)
        sets.append((model, lora))
    tables = sets[1][1].tables
    assert sets[0][1].tables is None and tables is not None
    for i, name in enumerate(order):
        for model, lora in sets:
            adapter = load_adapter(name, folders[name], model, MAX_RANK)
            lora.register(dataclasses.replace(adapter, name=f"{name}-{i}"))
            assert lora.make_resident(f"{name}-{i}", pinned=()) and lora.slots[f"{name}-{i}"] == 1
        for layer, want in sets[0][1].layers.items():
            got = sets[1][1].layers[layer]
            assert torch.equal(got.lora_a, want.lora_a) and torch.equal(got.lora_b, want.lora_b), (i, name, layer)
    # (None, k2), (k2, all16), (all16, mlp8), (mlp8, k2) built; (k2, all16), (all16, mlp8) kept; (mlp8, qv4) built
    assert tables.built == 5 and len(tables.tables) == 5
