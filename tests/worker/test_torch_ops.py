"""The PyTorch ops' rotary: q and k rotated in one pass where they are views of one fused output."""

from __future__ import annotations

import pytest
import torch

from worker.model.ops import TorchOps, apply_rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotating_fused_q_and_k_at_once_is_rotating_each(dtype):
    t, hq, hkv, d = 5, 6, 2, 8
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    angles = torch.rand(t, 1, d // 2, generator=gen) * 6
    cos, sin = (torch.cat((f, f), -1).to(dtype) for f in (angles.cos(), angles.sin()))
    got_q, got_k = TorchOps().rotate(q, k, cos, sin)
    assert torch.equal(got_q, apply_rotary(q, cos, sin)) and torch.equal(got_k, apply_rotary(k, cos, sin))
    apart_q, apart_k = q.contiguous(), k.contiguous()  # not adjacent in memory: each on its own
    got_q, got_k = TorchOps().rotate(apart_q, apart_k, cos, sin)
    assert torch.equal(got_q, apply_rotary(q, cos, sin)) and torch.equal(got_k, apply_rotary(k, cos, sin))
