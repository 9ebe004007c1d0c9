"""The request -> token table through which attention reads K and V.

``table[row, p]`` is the pool slot of the token at position ``p`` of the
request holding ``row``. The last row (``hold_row``) and the last pool slot
(``hold_slot``) are never handed out: CUDA-graph padding points at them.
"""

from __future__ import annotations

import numpy as np
import torch


class ReqTable:
    def __init__(self, max_requests: int, max_len: int, hold_slot: int, device: torch.device | str):
        self.max_len = max_len
        self.hold_row = max_requests
        self.table = torch.full((max_requests + 1, max_len), hold_slot, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def allocate_row(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: np.ndarray) -> None:
        """Record that positions start .. start+len(slots)-1 of ``row`` live in ``slots``."""
        end = start + len(slots)
        if end > self.max_len:
            raise ValueError(f"position {end} past the table's {self.max_len}")
        self.table[row, start:end] = torch.from_numpy(slots.astype(np.int32)).to(self.table.device, non_blocking=True)

    def write_scattered(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        """table[rows[i], positions[i]] = slots[i] for all i, in one indexed write (a decode step)."""
        device = self.table.device
        r = torch.from_numpy(rows.astype(np.int64)).to(device, non_blocking=True)
        p = torch.from_numpy(positions.astype(np.int64)).to(device, non_blocking=True)
        s = torch.from_numpy(slots.astype(np.int32)).to(device, non_blocking=True)
        self.table[r, p] = s
