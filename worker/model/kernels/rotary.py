"""Rotary position embedding, in place on q and k, rotate-half (HF Llama).

With x1 = x[..., :D/2], x2 = x[..., D/2:] and cos/sin of the token's position:
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
cos/sin are [T, D/2], already gathered by each token's position (the caller
indexes its cache with batch.positions), so the kernel never reads positions.
q and k may be strided views of one fused qkv projection output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_h, cos, sin, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # x_ptr: this token's first head; rotates heads [0, num_heads) in place.
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < num_heads)[:, None]
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, D/2]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_st,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and serve every q and k head.
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + t * stride_ct + offs_d).to(tl.float32)[None, :]  # [1, D/2]
    sin = tl.load(sin_ptr + t * stride_st + offs_d).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, num_q_heads, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, num_kv_heads, HALF, BLOCK_HK)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by cos/sin [T, D/2]."""
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2], (
        f"q {tuple(q.shape)} / k {tuple(k.shape)}: want [T, Hq, D] / [T, Hkv, D]"
    )
    num_tokens, num_q_heads, head_dim = q.shape
    half = head_dim // 2
    assert half >= 1 and half & (half - 1) == 0, f"head_dim {head_dim}: D/2 must be a power of two"
    assert cos.shape == sin.shape == (num_tokens, half), f"cos/sin {tuple(cos.shape)}: want [{num_tokens}, {half}]"
    assert q.dtype == k.dtype, f"q {q.dtype} vs k {k.dtype}"
    assert all(t.device == q.device for t in (k, cos, sin)), "all inputs on one device"
    assert all(t.stride(-1) == 1 for t in (q, k, cos, sin)), "last dim must be contiguous"
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        num_q_heads,
        num_kv_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        num_warps=4,
    )


def rotary_embedding_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotated copy of x [T, H, D] in fp32 math, returned in x's dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]  # [T, 1, D/2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
