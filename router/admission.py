"""Which worker may take a request: the one function the past-future check replaces.

Conservative admission (TGI's): a request needs ``prompt + max_new_tokens``
tokens for its whole life, and goes to a worker only if that fits the
worker's published free capacity less what this router dispatched there
since (reservations not yet reflected in the worker's record).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.schemas import GenerateRequest, WorkerLoad


def free_capacity(load: WorkerLoad, reserved_tokens: int) -> int:
    return load.free_tokens - reserved_tokens


def can_admit(load: WorkerLoad, reserved_tokens: int, request: GenerateRequest) -> bool:
    if load.draining:
        return False
    return request.max_tokens_needed <= free_capacity(load, reserved_tokens)


def choose_worker(loads: Mapping[str, WorkerLoad], reserved: Mapping[str, int],
                  request: GenerateRequest) -> str | None:
    """The admissible worker with the most free capacity, or None (the request waits)."""
    best: str | None = None
    best_free = -1
    for worker_id, load in sorted(loads.items()):
        held = reserved.get(worker_id, 0)
        if can_admit(load, held, request) and free_capacity(load, held) > best_free:
            best, best_free = worker_id, free_capacity(load, held)
    return best
