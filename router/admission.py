"""Which worker may take a request: the router's side of admission.

A worker's requests (its published ``ReqState`` list, plus the ones any
router dispatched there that its record does not show yet, plus the
candidate) must fit its pool by the chosen policy, and their count its
``running_max_req_size``. The rule is ``shared.peak.check``, beside the
peak formula so that workers can gate their own queues with the same code
(and bench/scheduler_sim.py runs it too); lengths come from ``shared.history``:

| policy                | projected use                               | limit        |
|-----------------------|---------------------------------------------|--------------|
| conservative          | sum of prompt + max_new_tokens (TGI's)      | pool         |
| aggressive            | sum of tokens held now (relies on pausing)  | pool * 0.95  |
| past_future           | worst peak over K Monte-Carlo length draws  | pool * (1-m) |
| past_future_quantile  | peak with every length at quantile q        | pool * (1-m) |

Published records lag by up to a heartbeat, which is safe for the peak:
requests that finished since only made the record pessimistic, and a peak
taken at the record's instant bounds every later step of the same batch.
A record without request summaries (an older worker) falls back to its
``committed_tokens``: the conservative check. Which of the workers that
pass gets the request is ``router.choice``'s: the least loaded, asked first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from shared.history import Estimator
from router.choice import least_loaded_fit
from router.worker_view import Candidate, Views
from shared.admission import request_state, request_states
from shared.peak import Policy, ReqState, check, projected_use
from shared.schemas import GenerateRequest, WorkerLoad

__all__ = ["check", "check_worker", "choose_view", "choose_worker", "request_state", "request_states"]


def check_worker(load: WorkerLoad, reserved: Sequence[ReqState], request: GenerateRequest,
                 policy: Policy, estimator: Estimator, margin: float) -> float | None:
    """``check`` against one worker's published record plus the dispatches it does not show yet."""
    if load.draining:
        return None
    candidate = request_states(request)
    if load.requests is None:  # no summaries published: only the conservative sum is known
        use = (load.committed_tokens + sum(s.conservative_need for s in reserved)
               + sum(s.conservative_need for s in candidate))
        return use / load.max_total_tokens if use <= load.max_total_tokens else None
    states = [ReqState(*r) for r in load.requests] + list(reserved)
    return check(states, candidate, load.max_total_tokens, load.running_max_req_size, policy, estimator, margin)


def worker_use(load: WorkerLoad, reserved: Sequence[ReqState], policy: Policy, estimator: Estimator) -> float:
    """A worker's projected use now over its pool, as ``check_worker`` projects it (draining: inf)."""
    if load.draining:
        return math.inf
    if load.requests is None:
        return (load.committed_tokens + sum(s.conservative_need for s in reserved)) / load.max_total_tokens
    states = [ReqState(*r) for r in load.requests] + list(reserved)
    return projected_use(states, policy, estimator) / load.max_total_tokens


def choose_worker(loads: Mapping[str, WorkerLoad], reserved: Mapping[str, Sequence[ReqState]],
                  request: GenerateRequest, policy: Policy, estimator: Estimator,
                  margin: float = 0.05) -> str | None:
    """The least loaded worker of the request's model that it fits (``router.choice``), or None
    (the request waits)."""
    uses = {worker_id: worker_use(load, reserved.get(worker_id, ()), policy, estimator)
            for worker_id, load in loads.items() if load.serves(request.model)}
    return least_loaded_fit(uses, lambda worker_id: check_worker(
        loads[worker_id], reserved.get(worker_id, ()), request, policy, estimator, margin))


def choose_view(views: Views, candidate: Candidate, model: str | None = None) -> str | None:
    """``choose_worker`` over prepared views (one request, not a group): the same choice, faster."""
    return views.choose(candidate, model)
