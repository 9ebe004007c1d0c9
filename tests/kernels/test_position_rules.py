"""ALiBi (BLOOM) and the sliding window (Mistral) in the prefill and decode kernels.

Each kernel against its reference, whose rule (worker.model.positions.position_scores)
the model tests check against transformers. Outputs start as NaN and pool
slots no request owns are NaN (helpers.make_pool), so a row left unwritten,
a split merged that stage 1 skipped, or a read outside a request's tokens
shows up as NaN.
"""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close, make_batch, make_pool
from worker.model.kernels.attention_reference import context_attention_ref, decode_attention_ref
from worker.model.kernels.context_attention import context_attention
from worker.model.kernels.copy_kv import copy_kv_ref
from worker.model.kernels.decode_attention import decode_attention
from worker.model.kernels.decode_launch import Stage1Tiles
from worker.model.layers import alibi_slopes
from worker.model.triton_attention import TritonAttention

ALIBI, WINDOW, BOTH = "alibi", "window", "alibi+window"


def _rules(kind: str, num_heads: int, window: int) -> dict:
    slopes = alibi_slopes(num_heads).to(DEVICE) if kind in (ALIBI, BOTH) else None
    return dict(alibi_slopes=slopes, window=window if kind in (WINDOW, BOTH) else None)


# (q_lens, cached_lens, Hq, Hkv, window, block_m, block_n): BLOOM-like MHA with
# a head count off a power of two, GQA, a chunked prefill (cached > 0), windows
# narrower than a tile, across several tiles, wider than the context, and 1.
PREFILL_CASES = [
    ([20, 1, 7], [0, 0, 0], 6, 6, 5, 16, 16),
    ([17, 3], [30, 9], 4, 2, 21, 16, 16),
    ([33, 2], [40, 0], 8, 2, 200, 32, 16),
    ([9], [12], 4, 4, 1, 16, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [ALIBI, WINDOW, BOTH])
@pytest.mark.parametrize("q_lens, cached_lens, num_heads, num_kv_heads, window, block_m, block_n", PREFILL_CASES)
def test_context_attention_rules(q_lens, cached_lens, num_heads, num_kv_heads, window, block_m, block_n, kind, dtype):
    batch = make_batch(q_lens, cached_lens)
    pool = make_pool(batch, num_kv_heads, 32, dtype)
    k_cache, v_cache = pool[:, :num_kv_heads], pool[:, num_kv_heads:]
    q = pool.new_empty(batch.num_tokens, num_heads, 32).normal_()
    o = q.new_full(q.shape, float("nan"))
    index = (batch.q_starts, batch.q_lens, batch.cached_lens, batch.seq_lens, batch.req_rows, batch.req_table)
    rules = _rules(kind, num_heads, window)
    context_attention(q, k_cache, v_cache, o, *index, batch.max_q_len, block_m=block_m, block_n=block_n, **rules)
    assert_close(o, context_attention_ref(q, k_cache, v_cache, *index, **rules))


# (seq_lens, Hq, Hkv, window, num_splits, block_n): the window starting inside
# a split, cutting off whole splits, wider than every context, and 1; a
# one-token request; one split.
DECODE_CASES = [
    ([1, 37, 130], 4, 2, 50, 5, 16),
    ([200, 9, 65], 8, 2, 30, None, 32),
    ([50, 3], 6, 6, 64, 1, 16),
    ([17, 70], 4, 4, 1, 3, 16),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [ALIBI, WINDOW, BOTH])
@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, window, num_splits, block_n", DECODE_CASES)
def test_decode_attention_rules(seq_lens, num_heads, num_kv_heads, window, num_splits, block_n, kind, dtype):
    batch = make_batch([1] * len(seq_lens), [s - 1 for s in seq_lens])
    pool = make_pool(batch, num_kv_heads, 32, dtype)
    k_cache, v_cache = pool[:, :num_kv_heads], pool[:, num_kv_heads:]
    q = pool.new_empty(len(seq_lens), num_heads, 32).normal_()
    o = q.new_full(q.shape, float("nan"))
    index = (batch.req_rows, batch.seq_lens, batch.req_table)
    rules = _rules(kind, num_heads, window)
    decode_attention(
        q,
        k_cache,
        v_cache,
        o,
        *index,
        batch.max_seq_len,
        num_splits=num_splits,
        tiles=Stage1Tiles(block_n=block_n),
        **rules,
    )
    assert_close(o, decode_attention_ref(q, k_cache, v_cache, *index, **rules))


def test_rules_change_the_result():
    """Guards the tests above against a rule that is silently ignored on both sides."""
    batch = make_batch([1, 1], [40, 9])
    pool = make_pool(batch, 2, 32, torch.float32)
    q = pool.new_empty(2, 4, 32).normal_()
    index = (pool[:, :2], pool[:, 2:], batch.req_rows, batch.seq_lens, batch.req_table)
    plain = decode_attention_ref(q, *index)
    for kind in (ALIBI, WINDOW):
        assert not torch.allclose(decode_attention_ref(q, *index, **_rules(kind, 4, 8))[0], plain[0])


def test_rules_are_checked():
    batch = make_batch([1], [4])
    pool = make_pool(batch, 2, 32, torch.float32)
    q = pool.new_empty(1, 4, 32).normal_()
    args = (q, pool[:, :2], pool[:, 2:], torch.empty_like(q), batch.req_rows, batch.seq_lens, batch.req_table, 5)
    with pytest.raises(AssertionError, match="alibi_slopes"):
        decode_attention(*args, alibi_slopes=torch.ones(3, device=DEVICE))
    with pytest.raises(AssertionError, match="window"):
        decode_attention(*args, window=0)


@pytest.mark.parametrize(
    "q_lens, cached_lens", [([6, 1, 19], [0, 4, 12]), ([1, 1, 1], [0, 20, 70])], ids=["prefill", "decode"]
)
def test_triton_attention_passes_rules(q_lens, cached_lens):
    """The backend hands both rules to whichever kernel runs (int32 indexes, as the runner makes them)."""
    batch = make_batch(q_lens, cached_lens)
    pool = make_pool(batch, 2, 32, torch.float32, poison_new=True)
    cache = SimpleNamespace(buffer=pool[None].clone())
    q = torch.randn(batch.num_tokens, 4, 32, device=DEVICE)
    k, v = torch.randn(batch.num_tokens, 2, 32, device=DEVICE), torch.randn(batch.num_tokens, 2, 32, device=DEVICE)
    rules = _rules(BOTH, 4, 9)
    expected_pool = pool.clone()
    copy_kv_ref(k, v, batch.out_slots, expected_pool)
    ref = context_attention_ref(
        q,
        expected_pool[:, :2],
        expected_pool[:, 2:],
        batch.q_starts,
        batch.q_lens,
        batch.cached_lens,
        batch.seq_lens,
        batch.req_rows,
        batch.req_table,
        **rules,
    )
    out = TritonAttention(cache).forward(0, q, k, v, replace(batch), **rules)
    assert_close(out, ref)


def test_both_kernels_refuse_mismatched_inputs_before_launching():
    """The pool checks both kernels share (``attention_inputs.check_pool_inputs``), and decode's own:
    one q row per request."""
    batch = make_batch([1, 1], [4, 2])
    pool = make_pool(batch, 2, 32, torch.float32)
    q = pool.new_empty(2, 4, 32).normal_()
    k, v, rows, lens, table = pool[:, :2], pool[:, 2:], batch.req_rows, batch.seq_lens, batch.req_table
    context = (q, k, v, batch.q_starts, batch.q_lens, batch.cached_lens, lens, rows, table, 1)
    with pytest.raises(AssertionError, match="not a multiple of Hkv"):
        decode_attention(pool.new_empty(2, 3, 32), k, v, pool.new_empty(2, 3, 32), rows, lens, table, 5)
    with pytest.raises(AssertionError, match="index tensors: integer"):
        decode_attention(q, k, v, torch.empty_like(q), rows.float(), lens, table, 5)
    with pytest.raises(AssertionError, match="want one each"):
        decode_attention(q[:1], k, v, torch.empty_like(q[:1]), rows, lens, table, 5)
    with pytest.raises(AssertionError, match="share a dtype"):
        context_attention(q, k, v, torch.empty_like(q, dtype=torch.float16), *context[3:])
    with pytest.raises(AssertionError, match="index tensors: integer"):
        context_attention(q, k, v, torch.empty_like(q), batch.q_starts, batch.q_lens.float(), *context[5:])
