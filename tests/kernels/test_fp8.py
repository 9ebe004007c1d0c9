"""FP8 kernels against PyTorch references that quantise the same way (``worker.model.ops.quantize_rows``).

The activation quantiser (alone, and inside the norm and SiLU-and-mul), the W8A16 GEMV, the FP8
pool's write (copy_kv) and both attention kernels reading an FP8 pool; outputs NaN-poisoned first, and pool slots no
request owns NaN in values and scales alike. Triton's CPU interpreter loads and stores
float8 (checked here: every test but the cuBLASLt one runs on the CPU too).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close, make_batch, make_pool, needs_cuda
from worker.model.kernels.attention_reference import context_attention_ref, decode_attention_ref
from worker.model.kernels.context_attention import context_attention
from worker.model.kernels.copy_kv import copy_kv, copy_kv_ref
from worker.model.kernels.decode_attention import decode_attention
from worker.model.kernels.decode_launch import Stage1Tiles
from worker.model.kernels.fp8_quant import quantize_rows as quantize_rows_kernel
from worker.model.kernels.gemv import GemvConfig, gemv, gemv_ref
from worker.model.kernels.rmsnorm import (
    fused_add_rmsnorm,
    fused_add_rmsnorm_fp8,
    fused_add_rmsnorm_ref,
    rmsnorm,
    rmsnorm_fp8,
    rmsnorm_ref,
)
from worker.model.kernels.silu_and_mul import silu_and_mul, silu_and_mul_fp8, silu_and_mul_ref
from worker.model.kernels.w8a16_gemm import W8A16Config, default_config, programs, small_rows_config, w8a16_matmul
from worker.model.ops import TorchOps, TritonOps
from worker.model.quant import FP8, FP8_MAX, QuantizedRows, quantize_rows
from worker.model.triton_attention import TritonAttention


def fp8_pool(pool: torch.Tensor, head_major: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool layer [S, 2Hkv, D] quantised per slot and head: NaN slots stay NaN in values and scales.
    The scales [S, 2Hkv] head-major in memory, as ``KVCache`` keeps them, or slot-major."""
    q, scales = quantize_rows(pool)
    return q, (scales.T.contiguous().T if head_major else scales)


LAYOUTS = pytest.mark.parametrize("head_major", [True, False], ids=["scales-head-major", "scales-slot-major"])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, k, block_k", [(1, 64, None), (7, 300, 128), (33, 1000, 256), (4, 48, 16)])
def test_quantize_rows_kernel_matches_reference(rows, k, block_k, dtype):
    x = (torch.randn(rows, k + 5, device=DEVICE) * torch.logspace(-3, 2, rows, device=DEVICE)[:, None]).to(dtype)
    x = x[:, :k]  # a strided view, as a projection's split output
    x[0, 3] = 0 if rows == 1 else x[0, 3]
    q, scale = quantize_rows_kernel(x, block_k=block_k)
    q_ref, scale_ref = quantize_rows(x)
    torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
    assert q.dtype == FP8 and not q.float().isnan().any()
    # Same fp32 quotient, same rounding: bit for bit (a tie rounded differently would show here).
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q.float().abs().amax(-1).eq(FP8_MAX).all()  # each row's largest value lands on 448


def test_quantize_rows_of_zeros_is_zeros():
    q, scale = quantize_rows_kernel(torch.zeros(3, 32, device=DEVICE))
    assert torch.equal(q.float(), torch.zeros(3, 32, device=DEVICE)) and (scale > 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, out_features, in_features, bias",
    [(17, 200, 100, True), (40, 128, 64, False), (130, 72, 160, True), (1100, 264, 96, False)],
)  # each BLOCK_M (32, 64, 128) of the default tiles; columns, K and rows past whole tiles;
# 9 row tiles at 1100 (the large-M config): two GROUP_M groups
def test_w8a16_gemm_matches_reference(rows, out_features, in_features, bias, dtype):
    """W8A16 above the GEMV's rows: the FP8 weight's tiles converted in registers, scales and bias on the
    fp32 sums; the reference is the same product in fp32 (gemv_ref), the output NaN-poisoned first."""
    check_w8a16(rows, out_features, in_features, bias, dtype)


def check_w8a16(rows: int, out_features: int, in_features: int, bias: bool, dtype, config=None) -> None:
    """``w8a16_matmul`` (``config``, or its default) on random inputs against gemv_ref's fp32 product
    of the same FP8 values, its output NaN-poisoned first."""
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    w, scale = quantize_rows(torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5)
    b = torch.randn(out_features, device=DEVICE).to(dtype) if bias else None
    out = torch.full((rows, out_features), float("nan"), device=DEVICE, dtype=dtype)
    w8a16_matmul(x, w, scale, b, out=out, config=config)
    assert_close(out, gemv_ref(x, w, b, scale))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, out_features, in_features, bias", [(20, 72, 1100, True), (33, 64, 2100, False)])
def test_w8a16_gemm_split_k_matches_reference(rows, out_features, in_features, bias, dtype):
    """A few rows over a long K: the small-rows config splits K (2 and 3 chunks, the last one ragged),
    the fp32 partial sums then added in order with the bias; the output NaN-poisoned first."""
    config = small_rows_config(rows, out_features, in_features, 132)
    assert config.split_k > 1
    check_w8a16(rows, out_features, in_features, bias, dtype, config)


W8A16_CONFIGS = [
    W8A16Config(16, 32, 32, split_k=3),  # three row tiles, unswapped, K in 160 / 160 / 80 (or 128 / 128 / 44)
    W8A16Config(32, 64, 64, swap_ab=True, num_stages=2),
    W8A16Config(64, 32, 128, split_k=2, num_warps=8, num_stages=2, swap_ab=True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", W8A16_CONFIGS, ids=["unswapped-split3", "swapped", "swapped-split2"])
@pytest.mark.parametrize("rows, out_features, in_features, bias", [(40, 96, 400, True), (17, 200, 300, False)])
def test_w8a16_gemm_configs_match_reference(rows, out_features, in_features, bias, config, dtype):
    """Explicit configs, as bench/engine/w8a16_tune.py passes them: tiles past the edges, both operand
    orders, split-K with and without the bias."""
    check_w8a16(rows, out_features, in_features, bias, dtype, config)


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])  # Llama-3-8B
def test_w8a16_small_rows_config_fills_an_h100(n, k):
    """On an H100 (132 SMs) 17-64 rows launch about two programs per SM, 138 and 256 (the partial sums
    capped) at least 128; above 256 rows, and at every row count by default, the config measured first
    (128 x 128 x 64 at 742 rows, no split)."""
    for rows in (17, 32, 64):
        assert programs(small_rows_config(rows, n, k, 132), rows, n, k) >= 256, rows  # about two per SM
    for rows in (138, 256):
        assert programs(small_rows_config(rows, n, k, 132), rows, n, k) >= 128, rows
    assert small_rows_config(742, n, k, 132) == default_config(742, n, k, 132) == W8A16Config(128, 128, 64, 1, 8, 3)
    assert default_config(32, n, k, 132) == W8A16Config(32, 128, 64, 1, 4, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [GemvConfig(16, 32, 1), GemvConfig(32, 64, 3)], ids=["split1", "split3"])
@pytest.mark.parametrize("rows, out_features, in_features, bias", [(1, 48, 96, False), (16, 64, 200, True)])
def test_gemv_fp8_weights_match_reference(rows, out_features, in_features, bias, config, dtype):
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    w, scale = quantize_rows(torch.randn(out_features, in_features, device=DEVICE) / in_features**0.5)
    b = torch.randn(out_features, device=DEVICE).to(dtype) if bias else None
    out = torch.full((rows, out_features), float("nan"), device=DEVICE, dtype=dtype)
    gemv(x, w, b, config, out=out, weight_scale=scale)
    assert_close(out, gemv_ref(x, w, b, scale))


@LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, num_kv_heads, head_dim", [(5, 2, 32), (1, 4, 16), (3, 3, 32)])
def test_copy_kv_fp8_matches_reference(num_tokens, num_kv_heads, head_dim, dtype, head_major):
    num_slots = 3 * num_tokens + 4
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, device=DEVICE).to(dtype)
    kv[0, 0] = 0  # an all-zero head: zeros and a positive scale, never NaN
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1 :]
    out_slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens].to(torch.int32)
    pool = torch.full((num_slots + 1, 2 * num_kv_heads, head_dim), float("nan"), device=DEVICE).to(FP8)
    scales = torch.full((num_slots + 1, 2 * num_kv_heads), float("nan"), device=DEVICE)
    scales = scales.T.contiguous().T if head_major else scales
    expected, expected_scales = pool.clone(), scales.clone()
    copy_kv(k, v, out_slots, pool, scales)
    copy_kv_ref(k, v, out_slots, expected, expected_scales)
    torch.testing.assert_close(scales, expected_scales, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(pool.view(torch.uint8), expected.view(torch.uint8))  # untouched slots too (NaN bytes)
    written = out_slots.long()
    assert not pool[written].float().isnan().any() and not scales[written].isnan().any()


DECODE_CASES = [([1, 37, 130], 4, 2, 32, None, 16), ([200, 9, 65], 8, 2, 32, 5, 32), ([50, 3], 4, 4, 16, 1, 16)]


@LAYOUTS
@pytest.mark.parametrize("fp16_dot", [False, True], ids=["dots-in-q-dtype", "fp16-dots"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, head_dim, num_splits, block_n", DECODE_CASES)
def test_decode_attention_fp8_pool_matches_reference(
    seq_lens, num_heads, num_kv_heads, head_dim, num_splits, block_n, dtype, fp16_dot, head_major
):
    batch = make_batch([1] * len(seq_lens), [s - 1 for s in seq_lens])
    pool, scales = fp8_pool(make_pool(batch, num_kv_heads, head_dim, torch.float32), head_major)
    caches = (pool[:, :num_kv_heads], pool[:, num_kv_heads:])
    kv_scales = dict(k_scale=scales[:, :num_kv_heads], v_scale=scales[:, num_kv_heads:])
    q = torch.randn(len(seq_lens), num_heads, head_dim, device=DEVICE).to(dtype)
    o = q.new_full(q.shape, float("nan"))
    index = (batch.req_rows, batch.seq_lens, batch.req_table)
    tiles = Stage1Tiles(block_n=block_n, fp16_dot=fp16_dot)  # fp16 dots: an FP8 pool's default (FP8_POOL_TILES)
    decode_attention(q, *caches, o, *index, batch.max_seq_len, num_splits=num_splits, tiles=tiles, **kv_scales)
    assert_close(o, decode_attention_ref(q, *caches, *index, **kv_scales))


CONTEXT_CASES = [([5, 1, 20], [0, 0, 0], 4, 2, 32, 16, 16), ([17, 3], [9, 30], 4, 4, 16, 16, 32)]


@LAYOUTS
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_m, block_n", CONTEXT_CASES)
def test_context_attention_fp8_pool_matches_reference(
    q_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_m, block_n, dtype, head_major
):
    batch = make_batch(q_lens, cached_lens)
    pool, scales = fp8_pool(make_pool(batch, num_kv_heads, head_dim, torch.float32), head_major)
    caches = (pool[:, :num_kv_heads], pool[:, num_kv_heads:])
    kv_scales = dict(k_scale=scales[:, :num_kv_heads], v_scale=scales[:, num_kv_heads:])
    q = torch.randn(batch.num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    o = q.new_full(q.shape, float("nan"))
    index = (batch.q_starts, batch.q_lens, batch.cached_lens, batch.seq_lens, batch.req_rows, batch.req_table)
    context_attention(q, *caches, o, *index, batch.max_q_len, block_m=block_m, block_n=block_n, **kv_scales)
    assert_close(o, context_attention_ref(q, *caches, *index, **kv_scales))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens, cached_lens", [([6, 1, 19], [0, 4, 12]), ([1, 1], [0, 40])], ids=["prefill", "decode"]
)
def test_triton_attention_on_an_fp8_pool(q_lens, cached_lens, dtype):
    """The backend's whole step: this step's K/V quantised into the pool, then read back by attention."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    batch = make_batch(q_lens, cached_lens)
    layer_pool, layer_scales = fp8_pool(make_pool(batch, num_kv_heads, head_dim, torch.float32, poison_new=True))
    cache = SimpleNamespace(buffer=layer_pool[None].clone(), scales=layer_scales[None].clone())
    q = torch.randn(batch.num_tokens, num_heads, head_dim, device=DEVICE).to(dtype)
    k, v = (torch.randn(batch.num_tokens, num_kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2))
    copy_kv_ref(k, v, batch.out_slots, layer_pool, layer_scales)
    index = (batch.q_starts, batch.q_lens, batch.cached_lens, batch.seq_lens, batch.req_rows, batch.req_table)
    split = dict(k_scale=layer_scales[:, :num_kv_heads], v_scale=layer_scales[:, num_kv_heads:])
    ref = context_attention_ref(q, layer_pool[:, :num_kv_heads], layer_pool[:, num_kv_heads:], *index, **split)
    out = TritonAttention(cache).forward(0, q, k, v, batch)
    assert_close(out, ref)
    assert torch.equal(cache.buffer[0].view(torch.uint8), layer_pool.view(torch.uint8))
    torch.testing.assert_close(cache.scales[0], layer_scales, atol=0, rtol=0, equal_nan=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8, 16, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_on_cuda_matches_the_reference(rows, bias):
    """cuBLASLt's row-wise scaled matmul (more than 16 rows) and the W8A16 GEMV (16 or fewer) against
    TorchOps' reference: x quantised per token, fp32 products; the GEMV keeps x in bf16, so it is
    checked against the same reference with x's quantisation error allowed for."""
    x = torch.randn(rows, 512, device=DEVICE, dtype=torch.bfloat16)
    w, scale = quantize_rows(torch.randn(384, 512, device=DEVICE) / 512**0.5)
    b = torch.randn(384, device=DEVICE, dtype=torch.bfloat16) if bias else None
    out = TritonOps().fp8_linear(x, w, scale, b)
    if rows > 16:
        assert_close(out, TorchOps().fp8_linear(x, w, scale, b), (3e-2, 3e-2))
    else:
        assert_close(out, gemv_ref(x, w, b, scale), (3e-2, 3e-2))


def poisoned_rows(rows: int, columns: int, dtype: torch.dtype) -> QuantizedRows:
    """An FP8 output with every byte NaN (e4m3fn's 0x7F) and NaN scales: an unwritten element shows."""
    q = torch.full((rows, columns), 0x7F, dtype=torch.uint8, device=DEVICE).view(FP8)
    return QuantizedRows(q, torch.full((rows,), float("nan"), device=DEVICE), dtype)


def assert_same_rows(out: QuantizedRows, q_ref: torch.Tensor, scale_ref: torch.Tensor) -> None:
    """Bit for bit: the fused kernels do the unfused kernels' fp32 operations in the same order."""
    assert not out.q.float().isnan().any() and not out.scale.isnan().any(), "unwritten"
    torch.testing.assert_close(out.scale, scale_ref, rtol=0, atol=0)
    assert torch.equal(out.q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden, residual", [(1, 16, False), (7, 96, True), (20, 1000, True), (3, 64, False)])
def test_rmsnorm_quantised_in_its_kernel_equals_the_norm_then_the_quantiser(rows, hidden, residual, dtype):
    """``rmsnorm_fp8`` / ``fused_add_rmsnorm_fp8`` against ``rmsnorm`` then ``quantize_rows`` (both
    kernels), to the bit; and against the PyTorch reference within one FP8 step."""
    x = (torch.randn(rows, hidden, device=DEVICE) * torch.logspace(-2, 2, rows, device=DEVICE)[:, None]).to(dtype)
    res = torch.randn(rows, hidden, device=DEVICE).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out = poisoned_rows(rows, hidden, dtype)
    if residual:
        got, res_out = fused_add_rmsnorm_fp8(x, res, w, 1e-6, out=out)
        y, res_ref = fused_add_rmsnorm(x, res, w, 1e-6)
        assert torch.equal(res_out, res_ref)
    else:
        got, y = rmsnorm_fp8(x, w, 1e-6, out=out), rmsnorm(x, w, 1e-6)
    assert got is out and got.dtype == dtype
    assert_same_rows(out, *quantize_rows_kernel(y))
    ref = fused_add_rmsnorm_ref(x, res, w, 1e-6)[0] if residual else rmsnorm_ref(x, w, 1e-6)
    q_ref, scale_ref = quantize_rows(ref)
    # One FP8 step of the largest value is 32 (of 448): a 1-ulp difference of the norm moves at most that.
    assert_close(
        out.q.float() * out.scale[:, None], q_ref.float() * scale_ref[:, None], (scale_ref.max().item() * 32, 0.07)
    )


@pytest.mark.parametrize("one_pass_max", [16384, 1], ids=["one-pass", "two-passes"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n_cols", [(1, 16), (5, 300), (9, 2500), (2, 4096)])
def test_silu_and_mul_quantised_in_its_kernel_equals_the_product_then_the_quantiser(rows, n_cols, dtype, one_pass_max):
    """``silu_and_mul_fp8``, a row in registers or in two passes over 2,048-column pieces (rows longer
    than a piece included), against ``silu_and_mul`` then ``quantize_rows`` (both kernels), to the
    bit, and against the PyTorch reference."""
    x = (torch.randn(rows, 2 * n_cols, device=DEVICE) * 3).to(dtype)
    out = poisoned_rows(rows, n_cols, dtype)
    assert silu_and_mul_fp8(x, out=out, one_pass_max=one_pass_max) is out
    assert_same_rows(out, *quantize_rows_kernel(silu_and_mul(x)))
    q_ref, scale_ref = quantize_rows(silu_and_mul_ref(x))
    assert_close(
        out.q.float() * out.scale[:, None], q_ref.float() * scale_ref[:, None], (scale_ref.max().item() * 32, 0.07)
    )


@pytest.mark.parametrize("backend", [TorchOps, pytest.param(TritonOps, marks=[pytest.mark.gpu, needs_cuda])])
def test_fp8_linear_takes_rows_quantised_before_it(backend):
    """The linear given ``QuantizedRows`` gives what it gives when it quantises the same rows itself."""
    ops = backend()
    x = torch.randn(40, 512, device=DEVICE, dtype=torch.bfloat16 if backend is TritonOps else torch.float32)
    w, scale = quantize_rows(torch.randn(384, 512, device=DEVICE) / 512**0.5)
    b = torch.randn(384, device=DEVICE, dtype=x.dtype)
    assert ops.quantizes_rows(40)
    rows = QuantizedRows(*quantize_rows(x), x.dtype)
    torch.testing.assert_close(ops.fp8_linear(rows, w, scale, b), ops.fp8_linear(x, w, scale, b), rtol=0, atol=0)
