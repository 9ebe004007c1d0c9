"""CPU decode matmuls through oneDNN on weights packed once (worker.model.layers.SmallBatchGemm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.model import layers
from worker.model.layers import SMALL_BATCH_ROWS, Linear, SmallBatchGemm, TensorParallel, pack_for_small_batches
from worker.model.models.base import VocabHead

needs_onednn = pytest.mark.skipif(
    SmallBatchGemm.make(torch.ones(4, 4), None, 8) is None, reason="this torch has no usable oneDNN linear"
)


def _filled(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


class Two(torch.nn.Module):
    def __init__(self, tp: TensorParallel = layers.SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.proj = Linear(24, 40, True, dtype, "cpu")
        self.head = VocabHead(24, 96, dtype, "cpu", tp)


@needs_onednn
def test_small_inputs_go_through_the_packed_weights_and_agree():
    model = _filled(Two())
    assert pack_for_small_batches(model) == (40 * 24 + 96 * 24) * 4
    assert model.proj.small is not None and model.head.small is not None
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 300):
        x = torch.randn(rows, 24, generator=gen)
        torch.testing.assert_close(model.proj(x), F.linear(x, model.proj.weight, model.proj.bias))
        torch.testing.assert_close(model.head(x), F.linear(x, model.head.weight))


@needs_onednn
def test_only_small_inputs_take_the_packed_path(monkeypatch):
    model = _filled(Two())
    pack_for_small_batches(model)
    calls = []

    def recorded(self, x: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return torch.zeros(x.shape[0], 1)

    monkeypatch.setattr(SmallBatchGemm, "__call__", recorded)
    model.proj(torch.randn(SMALL_BATCH_ROWS, 24))
    model.proj(torch.randn(SMALL_BATCH_ROWS + 1, 24))  # a prefill's size: F.linear
    model.head(torch.randn(500, 24))  # the output layer sees one row per request: always packed
    assert calls == [SMALL_BATCH_ROWS, 500]


@needs_onednn
@pytest.mark.skipif(not layers.packs(torch.bfloat16), reason="this CPU has no native bf16 for oneDNN")
def test_bf16_weights_are_packed_where_the_cpu_runs_bf16_and_agree():
    model = _filled(Two(dtype=torch.bfloat16))
    assert pack_for_small_batches(model) == (40 * 24 + 96 * 24) * 2
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 7, SMALL_BATCH_ROWS):
        x = torch.randn(rows, 24, generator=gen).to(torch.bfloat16)
        got = model.proj(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, F.linear(x, model.proj.weight, model.proj.bias), rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(model.head(x), F.linear(x, model.head.weight), rtol=2e-2, atol=5e-2)


def test_nothing_is_packed_off_the_cpu_fp32_or_bf16_single_process_path(monkeypatch):
    assert SmallBatchGemm.make(torch.ones(4, 4, dtype=torch.float16), None, 8) is None
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)  # a CPU without bf16
    assert SmallBatchGemm.make(torch.ones(4, 4, dtype=torch.bfloat16), None, 8) is None
    assert SmallBatchGemm.make(torch.ones(4, 4, device="meta"), None, 8) is None
    tp_model = _filled(Two(TensorParallel(rank=0, size=2)))
    assert pack_for_small_batches(tp_model) == 0 and tp_model.proj.small is None
    monkeypatch.setattr(layers, "PACK_BUDGET_BYTES", 100)  # weights past the memory budget
    model = _filled(Two())
    assert pack_for_small_batches(model) == 0 and model.head.small is None
