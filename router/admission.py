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
``committed_tokens``: the conservative check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shared.history import Estimator
from router.worker_view import Candidate, Views
from shared.peak import Policy, ReqState, check, group_states
from shared.schemas import GenerateRequest, WorkerLoad

__all__ = ["check", "check_worker", "choose_view", "choose_worker", "request_state", "request_states"]


def request_state(request: GenerateRequest) -> ReqState:
    """A request about to be dispatched; a resumed one has its emitted tokens already."""
    done = len(request.resume_ids)
    return ReqState(request.num_prompt_tokens + done, done, request.params.max_new_tokens,
                    int(request.params.ignore_eos))


def request_states(request: GenerateRequest) -> tuple[ReqState, ...]:
    """What a request adds to a worker: its state, or a group's open samples (the prompt counted once),
    each with the tokens it emitted before a requeue."""
    if request.n > 1:
        return tuple(group_states(request.num_prompt_tokens, [len(request.emitted(c)) for c in request.open_choices],
                                  request.params.max_new_tokens, int(request.params.ignore_eos)))
    return (request_state(request),)


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


def choose_worker(loads: Mapping[str, WorkerLoad], reserved: Mapping[str, Sequence[ReqState]],
                  request: GenerateRequest, policy: Policy, estimator: Estimator,
                  margin: float = 0.05) -> str | None:
    """The admissible worker with the lowest resulting use ratio, or None (the request waits)."""
    return lowest({worker_id: check_worker(load, reserved.get(worker_id, ()), request, policy, estimator, margin)
                   for worker_id, load in loads.items()})


def choose_view(views: Views, candidate: Candidate) -> str | None:
    """``choose_worker`` over prepared views (one request, not a group): the same choice, faster."""
    return lowest(views.ratios(candidate))


def lowest(ratios: Mapping[str, float | None]) -> str | None:
    """The worker with the lowest ratio among those that fit (not None); ties go to the first id."""
    fitting = [(ratio, worker_id) for worker_id, ratio in ratios.items() if ratio is not None]
    return min(fitting)[1] if fitting else None
