import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close
from worker.model.kernels.rotary import rotary_embedding, rotary_embedding_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim", [(5, 4, 2, 32), (1, 4, 4, 16), (6, 3, 1, 64)])
def test_rotary_matches_reference(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    # q and k as strided views of one fused qkv output, as the model has them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, device=DEVICE).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    angles = torch.rand(num_tokens, head_dim // 2, device=DEVICE) * 6.28  # random positions x frequencies
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_ref, k_ref = rotary_embedding_ref(q, cos, sin), rotary_embedding_ref(k, cos, sin)
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    rotary_embedding(q, k, cos, sin)
    # An element left unrotated would differ from the reference: sin is nonzero.
    assert_close(q, q_ref, TOL[dtype])
    assert_close(k, k_ref, TOL[dtype])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)  # v untouched
