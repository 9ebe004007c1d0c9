"""TokenAttention's slot allocator: a free-index stack over the KV pool.

Pages are one token, so a request holds exactly the slots it uses and
nothing is lost to fragmentation. Allocation pops from the top of the stack,
freeing pushes back (LIFO reuse); both are O(n) in the slots moved.
Pure bookkeeping: no torch, so the scheduler can be tested without it.
"""

from __future__ import annotations

import numpy as np


class TokenPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # free[:num_free] are the free slots; the rest is scratch.
        self._free = np.arange(num_slots, dtype=np.int64)
        self.num_free = num_slots

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def allocate(self, n: int) -> np.ndarray:
        if n > self.num_free:
            raise MemoryError(f"KV pool exhausted: asked {n} slots, {self.num_free} free")
        self.num_free -= n
        slots: np.ndarray = self._free[self.num_free : self.num_free + n].copy()
        return slots

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if self.num_free + n > self.num_slots:
            raise ValueError("freeing more slots than were allocated")
        self._free[self.num_free : self.num_free + n] = slots
        self.num_free += n
