"""What the two attention kernels (``context_attention``, ``decode_attention``) check and take of
their inputs alike: the position rules' arguments, an FP8 pool's scales against q and the cache, and
those scales' strides as both kernels read them."""

from __future__ import annotations

import torch

from worker.model.quant import FP8


def check_position_rules(q: torch.Tensor, alibi_slopes: torch.Tensor | None, window: int | None) -> None:
    """alibi_slopes: fp32 [Hq] on q's device; window: a positive int."""
    if alibi_slopes is not None:
        assert alibi_slopes.shape == (q.shape[1],) and alibi_slopes.dtype == torch.float32, (
            f"alibi_slopes {tuple(alibi_slopes.shape)} {alibi_slopes.dtype}: want fp32 [{q.shape[1]}]"
        )
        assert alibi_slopes.device == q.device and alibi_slopes.stride(0) == 1, (
            "alibi_slopes: contiguous, on q's device"
        )
    assert window is None or window >= 1, f"window {window}: want None or >= 1"


def check_kv_scales(q, k_cache, v_cache, k_scale, v_scale) -> None:
    """The pool's dtype against q's: the same, or FP8 with fp32 scales [S, Hkv]."""
    if k_scale is None and v_scale is None:
        assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache share a dtype (or the cache is FP8)"
        return
    assert k_cache.dtype == v_cache.dtype == FP8, f"scales given for a {k_cache.dtype} cache: want FP8"
    for scale in (k_scale, v_scale):
        assert scale is not None and scale.shape == k_cache.shape[:2] and scale.dtype == torch.float32, (
            f"k_scale / v_scale: want fp32 {tuple(k_cache.shape[:2])}"
        )
        assert scale.device == q.device, "scales on q's device"


def scale_strides(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[int, int, int, int]:
    """The kernels' stride_kss, stride_vss, stride_ksh, stride_vsh: scales [S, Hkv] by slot and head,
    either way round in memory (``worker.model.kv_cache`` keeps a head's slots contiguous); zeros
    when the pool is not FP8."""
    if k_scale is None or v_scale is None:
        return 0, 0, 0, 0
    return k_scale.stride(0), v_scale.stride(0), k_scale.stride(1), v_scale.stride(1)
