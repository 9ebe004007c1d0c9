import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close
from worker.model.kernels import silu_and_mul as mod
from worker.model.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows, n_cols", [(1, 16), (5, 100), (3, mod.BLOCK + 37)])
def test_silu_and_mul_matches_reference(num_rows, n_cols, dtype):
    x = (2 * torch.randn(num_rows, 2 * n_cols, device=DEVICE)).to(dtype)
    out = torch.full((num_rows, n_cols), float("nan"), device=DEVICE, dtype=dtype)
    silu_and_mul(x, out=out)
    assert_close(out, silu_and_mul_ref(x), TOL[dtype])
