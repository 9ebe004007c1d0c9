"""The LoRA kernels (SGMV for prefill segments, BGMV for decode tokens) against the PyTorch
reference (``worker.lora.delta.lora_delta_ref``) on random inputs: slots of different ranks (zero
padded as ``AdapterSet`` stacks them), slot 0 (no adapter) among them; the fp32 scratch between
shrink and expand is NaN-poisoned first, so a row the shrink did not write and the expand read
shows up as NaN."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.helpers import DEVICE, DTYPES, assert_close
from worker.lora.delta import lora_delta_ref
from worker.model.kernels.bgmv import bgmv, shrink_splits
from worker.model.kernels.bgmv_grouped import BLOCK_M, SPLIT_K, bgmv_grouped, group_tokens
from worker.model.kernels.lora_shards import Shards, expand_span
from worker.model.kernels.sgmv import sgmv


def stacks(num_slots: int, rank: int, k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, K], B [S, N, R]: slot 0 zeros, slot s of rank R - 3 (s - 1) (at least 1), zero padded."""
    a = torch.randn(num_slots, rank, k, device=DEVICE) / k**0.5
    b = torch.randn(num_slots, n, rank, device=DEVICE) / rank**0.5
    a[0], b[0] = 0, 0
    for s in range(1, num_slots):
        used = max(rank - 3 * (s - 1), 1)
        a[s, used:], b[s, :, used:] = 0, 0
    return a.to(dtype), b.to(dtype)


# SGMV's two tl.dot products (shrink, then expand) round fp32 inputs to tf32 on a GPU, each once: the
# H200 saw 1 in 100 elements up to 0.004 off (bf16 and fp16 keep helpers' bounds; the CPU interpreter is exact).
SGMV_FP32_CUDA = (6e-3, 6e-3)


def poisoned(t: int, r: int) -> torch.Tensor:
    return torch.full((t, r), float("nan"), dtype=torch.float32, device=DEVICE)


def expected(y: torch.Tensor, x, a, b, token_slots) -> torch.Tensor:
    return y.float() + lora_delta_ref(x, a, b, token_slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "q_lens, slots, rank, k, n",
    [
        ([5, 17, 1, 40], [1, 0, 3, 2], 16, 64, 96),  # segments across blocks, one without adapter
        ([33], [2], 8, 100, 70),  # one request, K and N not block multiples, rank below 16
        ([3, 3, 3], [3, 3, 1], 48, 72, 130),  # qkv-like stacked rank (3 x 16), two requests alike
    ],
)
def test_sgmv_matches_reference(q_lens, slots, rank, k, n, dtype):
    t = sum(q_lens)
    a, b = stacks(4, rank, k, n, dtype)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y = torch.randn(t, n, device=DEVICE).to(dtype)
    starts = torch.tensor([sum(q_lens[:i]) for i in range(len(q_lens))], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(q_lens, dtype=torch.int32, device=DEVICE)
    seg_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    want = expected(y, x, a, b, torch.repeat_interleave(seg_slots, lens.long()))
    sgmv(y, x, a, b, starts, lens, seg_slots, max(q_lens), v=poisoned(t, rank))
    assert_close(y, want.to(dtype), SGMV_FP32_CUDA if dtype == torch.float32 and DEVICE.type == "cuda" else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "slots, rank, k, n",
    [
        ([1, 0, 2, 3, 1, 0], 16, 64, 96),
        ([2], 4, 100, 70),
        ([3, 1, 2, 0, 0, 0, 0, 0], 192, 96, 130),  # rank 3 x 64 (qkv at the limit); padded graph rows
        ([2, 1, 0], 16, 1100, 40),  # K over 2 shrink splits and not a multiple of one
    ],
)
def test_bgmv_matches_reference(slots, rank, k, n, dtype):
    t = len(slots)
    a, b = stacks(4, rank, k, n, dtype)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y = torch.randn(t, n, device=DEVICE).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    want = expected(y, x, a, b, token_slots)
    bgmv(y, x, a, b, token_slots, v=poisoned(t, rank).expand(shrink_splits(k), t, rank).clone())
    assert_close(y, want.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "slots, rank, k, n",
    [
        ([3, 1, 0, 2, 1, 3, 0, 2, 1, 1, 3, 2, 0, 1, 2, 3, 1, 2, 0, 3, 1], 16, 64, 96),  # blocks of mixed slots
        ([2] * 20 + [0] * 12, 4, 100, 70),  # one slot over two blocks; padded graph rows
        ([3, 1, 2, 1, 0, 3], 192, 96, 130),  # rank 3 x 64 (qkv at the limit)
        ([2, 1, 0, 3, 3, 1, 2], 16, 1100, 40),  # K over 3 shrink splits and not a multiple of one
    ],
)
def test_grouped_bgmv_matches_reference(slots, rank, k, n, dtype):
    t = len(slots)
    a, b = stacks(4, rank, k, n, dtype)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y = torch.randn(t, n, device=DEVICE).to(dtype)
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    want = expected(y, x, a, b, token_slots)
    groups = group_tokens(token_slots, 4)
    places = groups.block_slots.shape[0] * BLOCK_M
    bgmv_grouped(y, x, a, b, groups, v=poisoned(places, rank).expand(-(-k // SPLIT_K), places, rank).clone())
    assert_close(y, want.to(dtype), SGMV_FP32_CUDA if dtype == torch.float32 and DEVICE.type == "cuda" else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_n, split_k", [(128, 256), (256, 1024)])
def test_both_decode_kernels_match_the_reference_at_other_tiles(block_n, split_k, dtype):
    """The tiles ``bench.engine.lora_kernels --tune`` sweeps: wider output tiles over fused shards on
    their boundaries (the zero blocks NaN, never read), K split in other chunks, poisoned scratch."""
    sizes, rank, k = [256, 256, 256], 16, 1100  # K over 1 to 5 splits, not a multiple of one
    a, b, seen = block_diagonal(sizes, rank, k, dtype, float("nan"))
    shards, r, n = Shards((256, 512, 768), rank), rank * len(sizes), sum(sizes)
    token_slots = torch.tensor([3, 1, 0, 2, 1, 3, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    t = token_slots.shape[0]
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y0 = torch.randn(t, n, device=DEVICE).to(dtype)
    want = expected(y0, x, a, seen, token_slots).to(dtype)
    splits = shrink_splits(k, split_k)
    y = y0.clone()
    bgmv(y, x, a, b, token_slots, v=poisoned(t, r).expand(splits, -1, r).clone(), shards=shards, block_n=block_n,
         split_k=split_k)  # fmt: skip
    assert_close(y, want)
    y, groups = y0.clone(), group_tokens(token_slots, 4)
    places = groups.block_slots.shape[0] * BLOCK_M
    v = poisoned(places, r).expand(splits, -1, r).clone()
    bgmv_grouped(y, x, a, b, groups, v=v, shards=shards, block_n=block_n, split_k=split_k)
    assert_close(y, want, SGMV_FP32_CUDA if dtype == torch.float32 and DEVICE.type == "cuda" else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_m", [32, 64])
def test_grouped_kernel_serves_a_prefills_segments_in_larger_blocks(block_m, dtype):
    """A prefill's tokens as the worker groups them (``worker.lora.delta.forward_groups``): each
    prompt a run of one slot (one longer than a block, one of a single token, a base one), in
    blocks of ``block_m``; scratch poisoned."""
    lengths, seg_slots = [70, 1, 9, 33, 5], [2, 3, 0, 1, 2]
    token_slots = torch.repeat_interleave(torch.tensor(seg_slots, dtype=torch.int32), torch.tensor(lengths)).to(DEVICE)
    t, rank, k, n = sum(lengths), 16, 300, 80
    a, b = stacks(4, rank, k, n, dtype)
    x = torch.randn(t, k, device=DEVICE).to(dtype)
    y = torch.randn(t, n, device=DEVICE).to(dtype)
    want = expected(y, x, a, b, token_slots)
    groups = group_tokens(token_slots, 4, block_m)
    assert groups.block_m == block_m and groups.tokens.shape[0] == groups.block_slots.shape[0] * block_m
    places = groups.block_slots.shape[0] * block_m
    bgmv_grouped(y, x, a, b, groups, v=poisoned(places, rank).expand(-(-k // SPLIT_K), places, rank).clone())
    assert_close(y, want.to(dtype), SGMV_FP32_CUDA if dtype == torch.float32 and DEVICE.type == "cuda" else None)


def test_grouping_puts_each_slots_tokens_in_whole_blocks_of_their_own():
    slots = torch.tensor([3, 1, 0, 3, 1, 1] + [2] * 17, dtype=torch.int32, device=DEVICE)
    groups = group_tokens(slots, 5)
    tokens, block_slots = groups.tokens.cpu().view(-1, BLOCK_M), groups.block_slots.cpu()
    assert block_slots.tolist() == [1, 2, 2, 3, 0, 0]  # cdiv(23, 16) + min(23, 4) blocks; slot 4 has none
    assert tokens[0, :3].tolist() == [1, 4, 5] and (tokens[0, 3:] == -1).all()  # slot 1, in the batch's order
    assert tokens[1].tolist() == list(range(6, 22)) and tokens[2, 0] == 22 and (tokens[2, 1:] == -1).all()
    assert tokens[3, :2].tolist() == [0, 3] and (tokens[4:] == -1).all()  # slot 0's token 2: nowhere


def test_slot_zero_leaves_y_untouched():
    a, b = stacks(2, 16, 32, 48, torch.float32)
    a[0], b[0] = float("nan"), float("nan")  # never read: slot 0 is skipped, not multiplied by zeros
    x, y = torch.randn(4, 32, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    before = y.clone()
    zeros = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    bgmv(y, x, a, b, zeros)
    sgmv(y, x, a, b, zeros[:1], torch.tensor([4], dtype=torch.int32, device=DEVICE), zeros[:1], 4)
    bgmv_grouped(y, x, a, b, group_tokens(zeros, 2))
    assert torch.equal(y, before)


def block_diagonal(sizes: list[int], rank: int, k: int, dtype: torch.dtype, off: float):
    """A [4, nR, K], B [4, N, nR] as ``AdapterSet`` stacks a fused layer of ``sizes`` rows: shard j's B
    block at its rows and ranks j R .. (j + 1) R (slot 2's shards of rank R - 5, zero padded), every
    other block of B ``off`` (NaN: a kernel that reads it shows it) -> (A, B, B as the reference sees it)."""
    n, shards = sum(sizes), len(sizes)
    a = torch.randn(4, shards * rank, k, device=DEVICE) / k**0.5
    b = torch.full((4, n, shards * rank), off, device=DEVICE)
    row = 0
    for j, size in enumerate(sizes):
        ranks = slice(j * rank, (j + 1) * rank)
        b[:, row : row + size, ranks] = torch.randn(4, size, rank, device=DEVICE) / rank**0.5
        a[2, j * rank + rank - 5 : (j + 1) * rank] = 0  # slot 2: rank R - 5 in every shard
        b[2, row : row + size, j * rank + rank - 5 : (j + 1) * rank] = 0
        row += size
    a[0], b[0] = 0, 0
    return a.to(dtype), b.to(dtype), torch.nan_to_num(b, nan=0.0).to(dtype)


def test_expand_span_skips_zero_blocks_only_where_tiles_fit_the_shards():
    assert expand_span(Shards((4096, 5120, 6144), 16), 6144, 48, 64) == (4096, 5120, 16)  # qkv
    assert expand_span(Shards((14336, 28672), 16), 28672, 32, 64) == (14336, 28672, 16)  # gate_up
    assert expand_span(Shards((64, 96, 128), 8), 128, 24, 64) == (128, 128, 24)  # 96: mid-tile, all ranks
    assert expand_span(Shards((4096,), 16), 4096, 16, 64) == (4096, 4096, 16)  # one shard
    assert expand_span(None, 100, 8, 64) == (100, 100, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [[128, 64, 64], [192, 64], [64, 32, 32]])
def test_kernels_skip_the_zero_blocks_of_a_fused_layer(sizes, dtype):
    """Shards on tile boundaries: the off-diagonal blocks are NaN and never read (y stays finite and
    right); [64, 32, 32] (a boundary mid-tile): every rank read, so those blocks must be zeros there."""
    rank, k, n = 16, 96, sum(sizes)
    aligned = all(sum(sizes[: j + 1]) % 64 == 0 for j in range(len(sizes)))
    a, b, seen = block_diagonal(sizes, rank, k, dtype, float("nan") if aligned else 0.0)
    shards = Shards(tuple(sum(sizes[: j + 1]) for j in range(len(sizes))), rank)
    r = rank * len(sizes)
    slots = [1, 2, 0, 3, 2, 1, 3]
    token_slots = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    x = torch.randn(len(slots), k, device=DEVICE).to(dtype)
    y0 = torch.randn(len(slots), n, device=DEVICE).to(dtype)
    want = expected(y0, x, a, seen, token_slots).to(dtype)
    tol = SGMV_FP32_CUDA if dtype == torch.float32 and DEVICE.type == "cuda" else None
    y = y0.clone()
    bgmv(y, x, a, b, token_slots, v=poisoned(len(slots), r).expand(shrink_splits(k), -1, r).clone(), shards=shards)
    assert_close(y, want)
    y, groups = y0.clone(), group_tokens(token_slots, 4)
    places = groups.block_slots.shape[0] * BLOCK_M
    bgmv_grouped(y, x, a, b, groups, v=poisoned(places, r).expand(-(-k // SPLIT_K), -1, r).clone(), shards=shards)
    assert_close(y, want, tol)
    y, ones = y0.clone(), torch.ones(len(slots), dtype=torch.int32, device=DEVICE)
    starts = torch.arange(len(slots), dtype=torch.int32, device=DEVICE)
    sgmv(y, x, a, b, starts, ones, token_slots, 1, v=poisoned(len(slots), r), shards=shards)
    assert_close(y, want, tol)
