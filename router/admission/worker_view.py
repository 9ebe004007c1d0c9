"""A worker as the router's admission check sees it (``WorkerView``): a
``shared.batch_view.BatchView`` of its published record plus this router's
reservations on it (``router.workers.reservations``), and what a request adds there.

The check counts only what a request adds to a worker, as the worker's own
check does (``Admission.adds``): a cached prefix that the record's running
requests hold (``WorkerLoad.held_prefixes``) is in their states already, so
at that worker the candidate counts its tokens less that prefix
(``Candidate.less``; the same draws, so still O(K log n)). A prefix that is
only evictable is counted in full: the worker counts it as free, and the
request would hold it again. The discount is never more than the worker's
own at the record's instant: held boundaries are multiples of the hash
block within the ids a worker may match (``cacheable_prompt``), and the
worker lists them after the states, from the same requests. A record can
be stale: if every holder of that prefix ends before the request arrives,
the worker counts it in full and the request may wait there until room
frees (the record then lists it). It never waits there for ever: a
candidate is discounted only where it would fit the pool alone, undiscounted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from shared.batch_view import BatchView, Candidate, Policy
from shared.peak import ReqState
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad


class WorkerView(BatchView):
    """A worker's record plus this router's reservations on it (``reserved``: counted as added).
    A draining worker takes nothing."""

    def __init__(self, load: WorkerLoad, reserved: Sequence[ReqState], policy: Policy):
        states = [ReqState(*r) for r in load.requests]
        super().__init__(states, load.max_total_tokens, load.running_max_req_size, policy)
        self.load = load
        self.prefixes = dict(load.prefixes)  # prefix hash -> tokens it covers
        # of those, the ones the record's requests hold (counted in their states)
        self.held = {load.prefixes[i][0]: load.prefixes[i][1] for i in load.held_prefixes if i < len(load.prefixes)}
        self.add(reserved)

    def hit(self, hashes: Sequence[int], within: Mapping[int, int] | None = None) -> int:
        """Tokens of the longest prefix (``hashes``: the prompt's) this worker's cache holds (of
        ``within``: those of its prefixes, by default all)."""
        prefixes = self.prefixes if within is None else within
        for h in reversed(hashes):
            if h in prefixes:
                return prefixes[h]
        return 0

    def ratio(self, candidate: Candidate, held: int = 0) -> float | None:
        """Use / pool with the candidate, ``held`` of whose tokens running requests here hold."""
        return None if self.load.draining else super().ratio(self.adds(candidate, held))

    def adds(self, candidate: Candidate, held: int) -> Candidate:
        """What the candidate adds here: less ``held`` (``Candidate.less``), unless it would not fit
        this pool alone in full (then a stale record could leave it waiting here for ever)."""
        return candidate.less(held) if held and self.fits_alone(candidate) else candidate

    def could_take(self, request: GenerateRequest, count: int, candidate: Callable[[], Candidate]) -> bool:
        """Whether ``request`` (``count`` states) could start here once the pool is empty: within the
        requests it runs at once, and either all its KV tokens within the admission limit or,
        failing that, the estimate of a ``candidate()`` of it (drawn only then: most fit in full)."""
        if self.max_requests is not None and count > self.max_requests:
            return False
        return request.max_tokens_needed <= self.limit or self.fits_alone(candidate())

    def use_ratio(self) -> float:
        """Use now / pool (a draining worker sorts last)."""
        return math.inf if self.load.draining else self.use() / self.max_total_tokens


def cacheable_prompt(request: GenerateRequest) -> Sequence[int]:
    """The prompt ids a worker may find cached for ``request`` (``worker.engine.kv_slots``'s
    ``_matchable`` on the message): all but the last, whose logits it needs, and none when it asks
    for the prompt's logprobs before any output (a cached position has no logits to score). What
    the router hashes, so neither a hit nor a discount counts a token the worker would prefill. None
    for a LoRA adapter's request: its K/V is the adapter's, never shared through the prefix cache."""
    if request.adapter is not None or (request.params.prompt_logprobs is not None and not request.resume_ids):
        return ()
    return request.prompt_ids[:-1]
