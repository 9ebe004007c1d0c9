import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close, make_batch, make_pool
from worker.model.kernels.attention_reference import decode_attention_ref
from worker.model.kernels.decode_attention import decode_attention
from worker.model.kernels.decode_launch import Stage1Tiles, choose_splits

# (seq_lens, Hq, Hkv, D, num_splits, block_n): a one-token context, lengths
# off the block and split multiples, one split, many splits (some past the
# shorter requests' ends), the automatic choice (None), GQA and MHA.
CASES = [
    ([1, 37, 130], 4, 2, 32, None, 16),
    ([50, 3], 4, 4, 16, 1, 16),
    ([1], 4, 2, 64, None, 16),
    ([200, 9, 65], 8, 2, 32, 5, 32),
    ([129, 300], 4, 2, 32, None, 64),
]


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_lens, num_heads, num_kv_heads, head_dim, num_splits, block_n", CASES)
def test_decode_attention_matches_reference(
    seq_lens, num_heads, num_kv_heads, head_dim, num_splits, block_n, dtype, head_major
):
    batch = make_batch([1] * len(seq_lens), [s - 1 for s in seq_lens])
    pool = make_pool(batch, num_kv_heads, head_dim, dtype)
    k_cache, v_cache = pool[:, :num_kv_heads], pool[:, num_kv_heads:]
    q = pool.new_empty(len(seq_lens), num_heads, head_dim).normal_()
    o = q.new_full(q.shape, float("nan"))
    index = (batch.req_rows, batch.seq_lens, batch.req_table)
    tiles = Stage1Tiles(block_n=block_n, head_major=head_major)
    decode_attention(q, k_cache, v_cache, o, *index, batch.max_seq_len, num_splits=num_splits, tiles=tiles)
    assert_close(o, decode_attention_ref(q, k_cache, v_cache, *index))


def test_zero_length_request_gives_zeros():
    # A CUDA-graph padding request may carry seq_len 0: zeros, never NaN.
    batch = make_batch([1, 1], [4, 0])
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = 0
    pool = make_pool(batch, 2, 16, torch.float32)
    q = pool.new_empty(2, 4, 16).normal_()
    o = q.new_full(q.shape, float("nan"))
    decode_attention(
        q, pool[:, :2], pool[:, 2:], o, batch.req_rows, seq_lens, batch.req_table, 5, tiles=Stage1Tiles(block_n=16)
    )
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    assert not o[0].isnan().any()


@pytest.mark.parametrize("batch_size, max_seq_len", [(1, 1), (1, 4096), (32, 1024), (256, 4096), (3, 100_000)])
def test_choose_splits_covers_max_seq_len(batch_size, max_seq_len):
    num_splits, split_len = choose_splits(batch_size, 8, max_seq_len, 132, 64)
    assert split_len % 64 == 0 and num_splits >= 1
    # The splits cover the context and none of them is empty at max_seq_len.
    assert (num_splits - 1) * split_len < max_seq_len <= num_splits * split_len
