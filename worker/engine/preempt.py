"""Pausing requests of a worse priority class for a better one that fits no worker (issue 19).

A router with ``--preempt`` whose best waiting request fits nowhere asks
the worker whose record lists the worst class (``WorkerLoad.preemptible``)
to make room (``shared.schemas.PreemptAsk``). The worker answers between
two steps: the victims are requests of classes strictly worse than the
ask's, the worst class first and inside it the newest first (the least
work lost; a waiting one that never started loses none), and only those
``Req.can_preempt`` allows. An ask names the requests at the head of the
router's queue, which it sends here with the ask: just enough victims are
taken for as many of them as can be made to fit (the first ones first) to
fit by the worker's own admission check over what stays; when not even the
first can, none is taken: a pause that admits nothing is pure loss.

A victim leaves the engine at once (its slots freed) and goes back to the
ingress stream with the tokens it emitted as ``resume_ids``, written by the
publisher after those tokens' chunks (``worker.service.publisher``), so
the worker that resumes it continues at the next index: the client sees a
gap, never a lost or repeated token. A started victim counts a preemption
(``GenerateRequest.preemptions``); at ``--max_preemptions`` it is never
chosen again, so a low class cannot be bounced around forever.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """The fewest requests to pause so that as many of the asked-for requests as can be made to
    fit here (a prefix of them) fit, whether they are in this worker's queue already or still on
    their way; empty when none can, or they fit already."""
    reqs = pool.requests()  # running in admission order, then waiting: reversed, newest first
    candidates = sorted(
        (r for r in reversed(reqs) if r.can_preempt(max_preemptions) and r.msg.priority > ask.priority),
        key=lambda r: -r.msg.priority,  # stable: newest first inside a class
    )
    if not candidates:
        return []
    policy, sizes = pool.rule.policy, ask.sizes
    ends = [sum(sizes[: j + 1]) for j in range(len(sizes))]  # states of the first j + 1 requests
    asked = set(ask.request_ids)  # those already here (sent with the ask) count as asked, not twice

    def fits(num_paused: int, num_asked: int) -> bool:
        paused = candidates[:num_paused]
        stay = [r for r in reqs if r not in paused and r.id not in asked]  # Req compares by identity
        view = BatchView(request_states(stay), pool.limits.max_total_tokens, pool.limits.running_max_req_size, policy)
        wanted = Candidate([ReqState(*s) for s in ask.states[: ends[num_asked - 1]]], policy)
        return view.ratio(wanted) is not None

    # Bisections (pausing more, or asking for fewer, never makes room scarcer): O(log n) checks
    # of O(n log n) each, not one per candidate, for a batch of a thousand requests.
    num_asked = _first(1, len(sizes) + 1, lambda j: not fits(len(candidates), j)) - 1
    if num_asked == 0:
        return []
    return candidates[: _first(0, len(candidates), lambda k: fits(k, num_asked))]


def _first(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The least ``k`` in [low, high) for which ``holds`` (monotone: false, then true), else ``high``."""
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return low


def handed_back(req: Req) -> tuple[GenerateRequest, bool]:
    """The message a victim goes back to the queue as, and whether its pause counts (it started:
    its prefill is lost). Call before the engine marks it finished."""
    started = req.phase is Phase.RUNNING or req.is_paused
    if not started:
        return req.msg, False  # never admitted here: it goes back as it came
    update: dict[str, object] = {"resume_ids": list(req.output_ids), "preemptions": req.msg.preemptions + 1}
    return req.msg.model_copy(update=update), True
