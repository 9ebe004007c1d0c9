"""Hashes of a prompt's prefixes at fixed token boundaries: how a worker says what its prefix
cache holds and how the router recognises it in a request (``worker.engine.radix_cache``,
``router.admission.views``).

``prefix_hashes(ids)[k]`` stands for ``ids[: (k + 1) * PREFIX_BLOCK]``: each hash is chained
from the previous one and the next block's ids, so equal hashes mean equal prefixes (up to a
64-bit collision, which costs a wrong routing guess, never a wrong token: the worker's own
tree decides what is shared). Both sides must call this one function with the same block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

PREFIX_BLOCK = 64  # tokens per boundary: a hit is known to the router to within this many tokens


def prefix_hashes(ids: Sequence[int], block: int = PREFIX_BLOCK, limit: int | None = None) -> list[int]:
    """One hash per whole block of ``ids`` (at most ``limit``), each covering the ids up to its
    block's end; non-negative 63-bit integers (exact in JSON)."""
    blocks = len(ids) // block if limit is None else min(len(ids) // block, limit)
    hashes: list[int] = []
    previous = b""
    for k in range(blocks):
        digest = hashlib.blake2b(previous + array("q", ids[k * block : (k + 1) * block]).tobytes(), digest_size=8)
        previous = digest.digest()
        hashes.append(int.from_bytes(previous, "little") >> 1)
    return hashes
