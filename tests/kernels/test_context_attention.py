import pytest

from tests.kernels.helpers import DTYPES, assert_close, make_batch, make_pool
from worker.model.kernels.attention_reference import context_attention_ref
from worker.model.kernels.context_attention import context_attention

# (q_lens, cached_lens, Hq, Hkv, D, block_m, block_n): lengths off the block
# multiples, chunked / cached prefill (cached_lens > 0), a one-token request,
# GQA and MHA, and the default blocks once.
CASES = [
    ([5, 1, 20], [0, 0, 0], 4, 2, 32, 16, 16),
    ([17, 3], [9, 30], 4, 4, 16, 16, 32),
    ([1], [0], 4, 2, 64, 16, 16),
    ([33, 2], [40, 0], 8, 2, 32, 32, 16),
    ([70, 6], [5, 61], 4, 2, 32, None, None),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_m, block_n", CASES)
def test_context_attention_matches_reference(
    q_lens, cached_lens, num_heads, num_kv_heads, head_dim, block_m, block_n, dtype
):
    batch = make_batch(q_lens, cached_lens)
    pool = make_pool(batch, num_kv_heads, head_dim, dtype)
    k_cache, v_cache = pool[:, :num_kv_heads], pool[:, num_kv_heads:]
    q = pool.new_empty(batch.num_tokens, num_heads, head_dim).normal_()
    o = q.new_full(q.shape, float("nan"))
    index = (batch.q_starts, batch.q_lens, batch.cached_lens, batch.seq_lens, batch.req_rows, batch.req_table)
    context_attention(q, k_cache, v_cache, o, *index, batch.max_q_len, block_m=block_m, block_n=block_n)
    assert_close(o, context_attention_ref(q, k_cache, v_cache, *index))
