"""Scatter one step's new K/V into their TokenAttention pool slots.

A pool layer is ``[num_slots + 1, 2 * Hkv, D]``: heads ``[0, Hkv)`` hold K,
``[Hkv, 2 * Hkv)`` hold V, so one token's K and V for a layer are one
contiguous run. Token ``t``'s K/V goes to slot ``out_slots[t]``. Under CUDA
graphs padded tokens point at the hold slot (the last one); several tokens
writing that slot is harmless because nothing reads it.

FP8 pool (``scales`` given, ``worker.model.kv_cache``): each head's D values are
quantised as they are stored, scale = max(amax / 448, FP8_MIN_SCALE) written to
``scales[slot, head]`` (K heads, then V heads), the operations of
``worker.model.ops.quantize_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.model.kernels.fp8_quant import INTERPRETED, fp8_scale, fp8_values
from worker.model.quant import FP8, FP8_MAX, FP8_MIN_SCALE, quantize_rows


@triton.jit
def _quantize_heads(x, FP8_LIMIT: tl.constexpr, MIN_SCALE: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """x [BLOCK_H, D] fp32 -> (x / scale clamped to +-448, scale [BLOCK_H]), one scale per head
    (ROUND_FIRST: rounded in fp32 already, for the interpreter's cast; see ``kernels.fp8_quant``)."""
    scale = fp8_scale(tl.max(tl.abs(x), 1), FP8_LIMIT, MIN_SCALE)
    return fp8_values(x, scale[:, None], FP8_LIMIT, ROUND_FIRST), scale


@triton.jit
def _copy_kv_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    pool_ptr,
    scales_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ps,
    stride_ph,
    stride_ss,
    stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    # One program per new token: it moves Hkv * D elements of K and of V.
    t = tl.program_id(0)
    # int64: slot * stride_ps overflows int32 once the pool holds ~1M tokens.
    slot = tl.load(slots_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dst = pool_ptr + slot * stride_ps + offs_h[:, None] * stride_ph + offs_d[None, :]
    if KV_FP8:
        k, k_scale = _quantize_heads(k.to(tl.float32), FP8_LIMIT, MIN_SCALE, ROUND_FIRST)
        v, v_scale = _quantize_heads(v.to(tl.float32), FP8_LIMIT, MIN_SCALE, ROUND_FIRST)
        h_mask = offs_h < NUM_KV_HEADS
        tl.store(scales_ptr + slot * stride_ss + offs_h * stride_sh, k_scale, mask=h_mask)
        tl.store(scales_ptr + slot * stride_ss + (NUM_KV_HEADS + offs_h) * stride_sh, v_scale, mask=h_mask)
    tl.store(dst, k.to(pool_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + NUM_KV_HEADS * stride_ph, v.to(pool_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    k: torch.Tensor, v: torch.Tensor, out_slots: torch.Tensor, pool_layer: torch.Tensor, scales: torch.Tensor | None
) -> None:
    assert k.dim() == 3 and k.shape == v.shape, f"k {tuple(k.shape)} / v {tuple(v.shape)}: want equal [T, Hkv, D]"
    num_tokens, num_kv_heads, head_dim = k.shape
    assert pool_layer.dim() == 3 and tuple(pool_layer.shape[1:]) == (2 * num_kv_heads, head_dim), (
        f"pool layer {tuple(pool_layer.shape)}: want [num_slots + 1, {2 * num_kv_heads}, {head_dim}]"
    )
    assert out_slots.shape == (num_tokens,), f"out_slots {tuple(out_slots.shape)}: want [{num_tokens}]"
    assert not out_slots.is_floating_point(), "out_slots must be an integer tensor"
    if scales is None:
        assert k.dtype == v.dtype == pool_layer.dtype, f"dtypes k {k.dtype} v {v.dtype} pool {pool_layer.dtype}"
    else:
        assert k.dtype == v.dtype and pool_layer.dtype == FP8, f"k {k.dtype}, v {v.dtype} into an FP8 pool"
        assert scales.shape == pool_layer.shape[:2] and scales.dtype == torch.float32, (
            f"scales {tuple(scales.shape)} {scales.dtype}: want fp32 [num_slots + 1, {2 * num_kv_heads}]"
        )
    assert k.device == v.device == out_slots.device == pool_layer.device, "all inputs on one device"
    # The kernel walks the head dim with unit stride; other dims may be views.
    assert k.stride(2) == v.stride(2) == pool_layer.stride(2) == 1, "head dim must be contiguous"
    assert head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"


def copy_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    out_slots: torch.Tensor,
    pool_layer: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """pool_layer[out_slots[t], :Hkv] = k[t]; pool_layer[out_slots[t], Hkv:] = v[t]; with ``scales``
    ([num_slots + 1, 2 * Hkv] fp32 of an FP8 pool layer) each head quantised, its scale stored there."""
    _check_inputs(k, v, out_slots, pool_layer, scales)
    num_tokens, num_kv_heads, head_dim = k.shape  # [T, Hkv, D]
    if num_tokens == 0:
        return
    _copy_kv_kernel[(num_tokens,)](
        k,
        v,
        out_slots,
        pool_layer,
        pool_layer if scales is None else scales,  # the pool stands in: never read
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        pool_layer.stride(0),
        pool_layer.stride(1),
        0 if scales is None else scales.stride(0),
        0 if scales is None else scales.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        KV_FP8=scales is not None,
        FP8_LIMIT=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        ROUND_FIRST=INTERPRETED,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )


def copy_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    out_slots: torch.Tensor,
    pool_layer: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    num_kv_heads = k.shape[1]
    slots = out_slots.long()
    if scales is None:
        pool_layer[slots, :num_kv_heads] = k
        pool_layer[slots, num_kv_heads:] = v
        return
    q, scale = quantize_rows(torch.cat((k, v), dim=1))  # [T, 2 * Hkv, D], [T, 2 * Hkv]
    pool_layer[slots] = q
    scales[slots] = scale
