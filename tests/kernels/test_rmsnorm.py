import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close
from worker.model.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref

SHAPES = [(1, 16), (7, 96), (4, 1000)]  # 96 and 1000: rows off a power of two
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden", SHAPES)
def test_rmsnorm_matches_reference(num_rows, hidden, dtype):
    x = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    y = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-5, out=y)
    assert_close(y, rmsnorm_ref(x, w, 1e-5), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, hidden", SHAPES)
def test_fused_add_rmsnorm_matches_reference(num_rows, hidden, dtype):
    x = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(num_rows, hidden, device=DEVICE).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    y, res_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    fused_add_rmsnorm(x, residual, w, 1e-6, out=y, residual_out=res_out)
    y_ref, res_ref = fused_add_rmsnorm_ref(x, residual, w, 1e-6)
    assert_close(res_out, res_ref, (0, 0))  # the rounded sum is exact
    assert_close(y, y_ref, TOL[dtype])


def test_fused_add_rmsnorm_in_place():
    x = torch.randn(5, 64, device=DEVICE)
    residual = torch.randn(5, 64, device=DEVICE)
    w = torch.randn(64, device=DEVICE)
    y_ref, res_ref = fused_add_rmsnorm_ref(x, residual, w, 1e-6)
    fused_add_rmsnorm(x, residual, w, 1e-6, out=x, residual_out=residual)
    assert_close(x, y_ref, TOL[torch.float32])
    assert_close(residual, res_ref, (0, 0))
