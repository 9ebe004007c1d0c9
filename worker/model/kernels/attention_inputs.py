"""What the two attention kernels (``context_attention``, ``decode_attention``) check and take of
their inputs alike: q, o, the pool's K/V views, the index tensors and the request table; the position
rules' arguments, an FP8 pool's scales against q and the cache, and those scales' strides as both
kernels read them."""

from __future__ import annotations

import torch

from worker.model.quant import FP8


def check_pool_inputs(q, k_cache, v_cache, o, index_tensors: tuple[torch.Tensor, ...], req_table) -> None:
    """q and o [rows, Hq, D] (rows: a prefill's packed tokens, a decode's requests); k_cache and
    v_cache [S, Hkv, D] views of one pool layer; each index tensor integer [B]; one device."""
    assert q.dim() == 3 and o.shape == q.shape, f"q {tuple(q.shape)} / o {tuple(o.shape)}: want [rows, Hq, D]"
    assert k_cache.dim() == 3 and k_cache.shape == v_cache.shape, "k_cache / v_cache: want equal [S, Hkv, D]"
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    assert k_cache.shape[2] == head_dim, f"head_dim q {head_dim} vs cache {k_cache.shape[2]}"
    assert num_heads % num_kv_heads == 0, f"Hq {num_heads} not a multiple of Hkv {num_kv_heads}"
    assert head_dim >= 16 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim}: power of two >= 16 (tl.dot)"
    assert q.dtype == o.dtype, "q and o share a dtype"
    assert all(t.stride(-1) == 1 for t in (q, o, k_cache, v_cache)), "head dim must be contiguous"
    batch = index_tensors[0].shape[0]
    for t in index_tensors:
        assert t.shape == (batch,) and not t.is_floating_point(), "index tensors: integer [B]"
    assert req_table.dim() == 2 and req_table.stride(1) == 1 and not req_table.is_floating_point()
    devices = {t.device for t in (q, k_cache, v_cache, o, req_table, *index_tensors)}
    assert len(devices) == 1, f"inputs on several devices: {devices}"


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
