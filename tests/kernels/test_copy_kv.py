import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES
from worker.model.kernels.copy_kv import copy_kv, copy_kv_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim", [(5, 2, 32), (1, 4, 16), (9, 1, 64), (3, 3, 32)])
def test_copy_kv_matches_reference(num_tokens, num_kv_heads, head_dim, dtype):
    num_slots = 3 * num_tokens + 4
    # k and v as views of one fused projection output, as the model produces them.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, device=DEVICE).to(dtype)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1 :]  # [T, Hkv, D], token stride (2Hkv+1)D
    out_slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens].to(torch.int32)
    pool = torch.full((num_slots + 1, 2 * num_kv_heads, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    expected = pool.clone()
    copy_kv(k, v, out_slots, pool)
    copy_kv_ref(k, v, out_slots, expected)
    # Exact: written slots hold k/v, every other slot is still NaN (no stray writes).
    torch.testing.assert_close(pool, expected, atol=0, rtol=0, equal_nan=True)
    assert not pool[out_slots.long()].isnan().any()


def test_copy_kv_rejects_mismatched_pool():
    k = torch.randn(2, 2, 16, device=DEVICE)
    pool = torch.empty(5, 2, 16, device=DEVICE)  # one K/V head pair, k has two
    with pytest.raises(AssertionError):
        copy_kv(k, k, torch.tensor([0, 1], device=DEVICE), pool)
