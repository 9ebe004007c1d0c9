"""Pausing requests of a worse priority class for a better one that fits no worker (issue 19).

A router with ``--preempt`` whose best waiting request fits nowhere asks
the worker whose record lists the worst class (``WorkerLoad.preemptible``)
to make room (``shared.schemas.PreemptAsk``). The worker answers between
two steps: the victims are requests of classes strictly worse than the
ask's, the worst class first and inside it the newest first (the least
work lost; a waiting one that never started loses none), and only those
``Req.can_preempt`` allows. Just enough are taken for the asked-for states
to fit by the worker's own admission check over what stays; when even all
of them would not make room, none is taken: a pause that admits nothing is
pure loss.

A victim leaves the engine at once (its slots freed) and goes back to the
ingress stream with the tokens it emitted as ``resume_ids``, written by the
publisher after those tokens' chunks (``worker.service.publisher``), so
the worker that resumes it continues at the next index: the client sees a
gap, never a lost or repeated token. A started victim counts a preemption
(``GenerateRequest.preemptions``); at ``--max_preemptions`` it is never
chosen again, so a low class cannot be bounced around forever.
"""

from __future__ import annotations

from typing import Protocol

from shared.admission import AdmissionRule
from shared.batch_view import BatchView, Candidate
from shared.peak import ReqState
from shared.schemas import GenerateRequest, PreemptAsk
from worker.engine.load import Limits, request_states
from worker.engine.request import Phase, Req


class Pool(Protocol):
    """What the plan reads of ``worker.engine.engine.Engine``."""

    @property
    def limits(self) -> Limits: ...

    rule: AdmissionRule

    def requests(self) -> list[Req]: ...


def plan(pool: Pool, ask: PreemptAsk, max_preemptions: int) -> list[Req]:
    """The requests to pause so that ``ask.states`` fit here; empty when they fit already or
    cannot be made to fit."""
    reqs = pool.requests()  # running in admission order, then waiting: reversed, newest first
    candidates = sorted(
        (r for r in reversed(reqs) if r.can_preempt(max_preemptions) and r.msg.priority > ask.priority),
        key=lambda r: -r.msg.priority,  # stable: newest first inside a class
    )
    policy = pool.rule.policy
    wanted = Candidate([ReqState(*s) for s in ask.states], policy)

    def fits(victims: list[Req]) -> bool:
        stay = [r for r in reqs if r not in victims]  # Req compares by identity
        view = BatchView(request_states(stay), pool.limits.max_total_tokens, pool.limits.running_max_req_size, policy)
        return view.ratio(wanted) is not None

    if not candidates or fits([]) or not fits(candidates):
        return []
    # The fewest that make room, by bisection (pausing more never makes room scarcer): O(log n)
    # checks of O(n log n) each, not one per candidate, for a batch of a thousand requests.
    low, high = 0, len(candidates)  # invariant: the first ``low`` do not make room, the first ``high`` do
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(candidates[:mid]) else (mid, high)
    return candidates[:high]


def handed_back(req: Req) -> tuple[GenerateRequest, bool]:
    """The message a victim goes back to the queue as, and whether its pause counts (it started:
    its prefill is lost). Call before the engine marks it finished."""
    started = req.phase is Phase.RUNNING or req.is_paused
    if not started:
        return req.msg, False  # never admitted here: it goes back as it came
    update: dict[str, object] = {"resume_ids": list(req.output_ids), "preemptions": req.msg.preemptions + 1}
    return req.msg.model_copy(update=update), True
