"""The small-batch matmul kernel against x.float() @ W.float().T, outputs NaN-poisoned first."""

import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close
from worker.model.kernels.gemv import MAX_ROWS, GemvConfig, default_config, gemv, gemv_ref

CONFIGS = [GemvConfig(16, 32, 1), GemvConfig(32, 64, 3), GemvConfig(16, 16, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 48, 96), (5, 70, 200), (MAX_ROWS, 33, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(rows, out_features, in_features, config, bias, dtype):
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    # Scaled so outputs are O(1) whatever K is; a view with a row stride wider than K.
    weight = (torch.randn(out_features, in_features + 8, device=DEVICE) / in_features**0.5).to(dtype)[:, :in_features]
    b = torch.randn(out_features, device=DEVICE).to(dtype) if bias else None
    out = torch.full((rows, out_features), float("nan"), device=DEVICE, dtype=dtype)
    gemv(x, weight, b, config, out=out)
    assert_close(out, gemv_ref(x, weight, b))


def test_no_rows():
    out = gemv(torch.randn(0, 64, device=DEVICE), torch.randn(32, 64, device=DEVICE), None, CONFIGS[0])
    assert out.shape == (0, 32)


def test_default_config_fills_the_device():
    # A square 4096 weight on 132 SMs: 128 column tiles, split until ~4 programs per SM.
    config = default_config(4096, 4096, 132)
    assert (4096 // config.block_n) * config.split_k >= 4 * 132
    # A wide weight (the LM head) needs no split.
    assert default_config(128256, 4096, 132).split_k == 1
