"""A fused layer's LoRA stacks are block diagonal: what the expand kernels may skip.

``worker.lora.adapter_set`` stacks a fused layer's shards (qkv: 3, gate_up: 2) side by side: shard
k's A rows are k R .. (k + 1) R and its B block sits at the shard's output rows and the same R
columns, zero elsewhere. An expand (y += v B^T) that multiplies all n R columns for every output
row reads and multiplies the zero blocks too: on Llama-3-8B at rank 16, 126 MB an adapter a step
where 84 are needed. When every shard boundary falls on an output tile's boundary, a tile lies in
one shard and reads that shard's R columns of v and B alone (``expand_span``); otherwise (small test
shapes) every tile reads all of them, as before, with the same result. In a kernel, the tile at output
row c0 reads from column ((c0 >= END0) + (c0 >= END1)) * RS. No triton here: ``LoraLinear`` builds its
``Shards`` on a CPU too (``worker.model.kernels`` imports triton only where a kernel is).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_SHARDS = 3  # the kernels take two inner boundaries


@dataclass(frozen=True)
class Shards:
    ends: tuple[int, ...]  # each shard's last output row + 1, in order
    rank: int  # B's columns (ranks) per shard


def expand_span(shards: Shards | None, n: int, r: int, block_n: int) -> tuple[int, int, int]:
    """(end0, end1, ranks) for an expand over output tiles ``block_n`` wide: the first two shard ends
    (n where there are fewer) and the ranks a tile reads; (n, n, r) where tiles cannot skip."""
    if shards is None or len(shards.ends) == 1 or len(shards.ends) > MAX_SHARDS:
        return n, n, r
    inner = shards.ends[:-1]
    if shards.ends[-1] != n or shards.rank * len(shards.ends) != r or any(end % block_n for end in inner):
        return n, n, r
    inner = inner + (n,) * (MAX_SHARDS - 1 - len(inner))
    return inner[0], inner[1], shards.rank


def block_ranks(ranks: int) -> int:
    """A tile's rank dimension: a power of two, at least 16 (tl.dot)."""
    return max(1 << (ranks - 1).bit_length(), 16)
