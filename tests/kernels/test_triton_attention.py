"""TritonAttention end to end: pool write + attention, against the references."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close, make_batch, make_pool, needs_cuda
from worker.model.kernels.attention_reference import context_attention_ref
from worker.model.kernels.copy_kv import copy_kv_ref
from worker.model.triton_attention import TritonAttention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, LAYER = 4, 2, 32, 1
INDEX_FIELDS = ("out_slots", "req_rows", "cached_lens", "seq_lens", "q_starts", "q_lens")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens, cached_lens", [([6, 1, 19], [0, 4, 12]), ([1, 1, 1], [0, 20, 70])], ids=["prefill", "decode"]
)
def test_forward_matches_reference(q_lens, cached_lens, dtype, index_dtype):
    batch = make_batch(q_lens, cached_lens)
    # The kernels take int32 or int64 indexes (the request table itself stays int32).
    batch = replace(batch, **{f: getattr(batch, f).to(index_dtype) for f in INDEX_FIELDS})
    assert batch.is_decode == all(q == 1 for q in q_lens)
    # The new slots are NaN until forward writes them.
    layer_pool = make_pool(batch, NUM_KV_HEADS, HEAD_DIM, dtype, poison_new=True)
    buffer = torch.randn(3, *layer_pool.shape, device=DEVICE).to(dtype)
    buffer[LAYER] = layer_pool
    cache = SimpleNamespace(buffer=buffer)
    q = torch.randn(batch.num_tokens, NUM_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    k = torch.randn(batch.num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    v = torch.randn_like(k)

    expected_pool = layer_pool.clone()
    copy_kv_ref(k, v, batch.out_slots, expected_pool)
    ref = context_attention_ref(
        q,
        expected_pool[:, :NUM_KV_HEADS],
        expected_pool[:, NUM_KV_HEADS:],
        batch.q_starts,
        batch.q_lens,
        batch.cached_lens,
        batch.seq_lens,
        batch.req_rows,
        batch.req_table,
    )
    others = buffer[[0, 2]].clone()

    out = TritonAttention(cache).forward(LAYER, q, k, v, batch)
    assert out.shape == q.shape
    assert_close(out, ref)
    torch.testing.assert_close(buffer[LAYER], expected_pool, atol=0, rtol=0, equal_nan=True)
    assert torch.equal(buffer[[0, 2]], others)  # other layers untouched


@pytest.mark.gpu
@needs_cuda
def test_decode_forward_replays_under_cuda_graph():
    # Capture at max_seq_len 100, replay with other lengths, slots and inputs:
    # forward must read everything per request on the device (no host sync).
    batch = make_batch([1, 1, 1], [10, 50, 99])
    layer_pool = make_pool(batch, NUM_KV_HEADS, HEAD_DIM, torch.float16)
    cache = SimpleNamespace(buffer=layer_pool[None].clone())
    q = torch.randn(3, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.float16)
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.float16)
    v = torch.randn_like(k)
    attn = TritonAttention(cache)
    attn.forward(0, q, k, v, batch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attn.forward(0, q, k, v, batch)

    new_seq = torch.tensor([3, 40, 100], device=DEVICE, dtype=torch.int32)
    batch.seq_lens.copy_(new_seq)
    batch.cached_lens.copy_(new_seq - 1)
    batch.out_slots.copy_(batch.req_table[batch.req_rows.long(), (new_seq - 1).long()])
    for t in (q, k, v):
        t.normal_()
    expected_pool = cache.buffer[0].clone()
    copy_kv_ref(k, v, batch.out_slots, expected_pool)
    ref = context_attention_ref(
        q,
        expected_pool[:, :NUM_KV_HEADS],
        expected_pool[:, NUM_KV_HEADS:],
        batch.q_starts,
        batch.q_lens,
        batch.cached_lens,
        batch.seq_lens,
        batch.req_rows,
        batch.req_table,
    )
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, ref)
