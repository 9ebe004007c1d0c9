"""How ``decode_attention`` launches: the split of each request's context (``choose_splits``, from
host ints only, so a captured CUDA graph keeps it) and stage 1's tiles (``Stage1Tiles``)."""

from __future__ import annotations

from dataclasses import dataclass

import triton

# Split choice and tiles from a sweep on an H200 (Llama-3-8B shapes, bf16, CUDA graphs):
# B=256 x 4k context reads K/V at ~4.3 TB/s, the card's measured copy rate.
MIN_SPLIT_LEN = 128  # shorter splits spend more on stage 2 than they win in parallelism
MAX_SPLITS = 64
PROGRAMS_PER_SM = 4  # stage-1 programs aimed at per SM when B * Hkv alone is too few
DEFAULT_BLOCK_N = 128


@dataclass(frozen=True)
class Stage1Tiles:
    """Stage 1's launch shape (``bench.engine.decode_attention_tune`` sweeps these)."""

    block_n: int = DEFAULT_BLOCK_N
    num_warps: int = 4
    num_stages: int = 3
    # Head-major: 2.8% less time summed over B = 8..768 on the slot layout decoding makes, up to 3% at
    # B = 256 and 768 (bench.engine.decode_attention_tune on an H200, bench/RESULTS.md, issue 16).
    head_major: bool = True
    # An FP8 pool only: the dots in fp16 (q and the probabilities converted once, K and V by the
    # hardware's e4m3 -> fp16) rather than in q's dtype (bf16: two conversions a K/V value on sm90).
    fp16_dot: bool = False


# An FP8 pool: the dots in fp16, four stages. 10% less time than bf16 dots at B=64 x 8,192 tokens
# (2.48 against 2.24 TB/s of K/V), 2% at B=256 / 768 x 512 (bench.engine.decode_attention_tune --kv fp8,
# an H100, bench/RESULTS.md).
FP8_POOL_TILES = Stage1Tiles(num_stages=4, fp16_dot=True)


def choose_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int) -> tuple[int, int]:
    """(num_splits, split_len) from host ints only: about PROGRAMS_PER_SM per SM,
    no split shorter than MIN_SPLIT_LEN, split_len a multiple of block_n."""
    want = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(1, batch * num_kv_heads))
    by_len = triton.cdiv(max_seq_len, MIN_SPLIT_LEN)
    num_splits = max(1, min(want, by_len, MAX_SPLITS))
    split_len = triton.cdiv(triton.cdiv(max(1, max_seq_len), num_splits), block_n) * block_n
    return triton.cdiv(max(1, max_seq_len), split_len), split_len
