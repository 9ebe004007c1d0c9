"""Pausing requests of a worse priority class for a better one that fits no worker (issue 19).

A router with ``--preempt`` whose best waiting request fits nowhere asks
the worker whose record lists the worst class (``WorkerLoad.preemptible``)
to make room (``shared.worker_load.PreemptAsk``). The worker answers between
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
publisher after those tokens' chunks (``worker.service.pending``), so
the worker that resumes it continues at the next index: the client sees a
gap, never a lost or repeated token. A group (n > 1) is one victim: all its
samples stop together (they share the prompt's slots and one inbox entry)
and it goes back as one message, as a requeued group does
(``shared.requeue``): each sample's tokens so far in ``group_resume`` and
the samples that ended here, or before, in ``finished_choices``; the
worker that resumes it prefills the prompt once, runs only the open
samples, each after its own tokens. The plan weighs a group by all its
samples: pausing one sample alone would free its own tokens only and
leave the group's prompt held. A started victim counts a preemption
(``GenerateRequest.preemptions``); at ``--max_preemptions`` it is never
chosen again, so a low class cannot be bounced around forever.

A worker with ``--preempt`` also asks itself (``unasked_plan``) for requests
that arrive without an ask: a router decides on records, which may be older
than what they describe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from shared.admission import AdmissionRule
from shared.admission import request_states as message_states
from shared.batch_view import BatchView, Candidate
from shared.peak import ReqState
from shared.schemas import GenerateRequest
from shared.worker_load import PreemptAsk
from worker.engine.load import Limits, request_states
from worker.engine.request import Group, Phase, Req, by_request


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
    candidates = sorted(  # a group by its newest sample, all of its samples at once
        (
            unit
            for unit in by_request(reversed(reqs))
            if all(r.can_preempt(max_preemptions) for r in unit) and unit[0].msg.priority > ask.priority
        ),
        key=lambda unit: -unit[0].msg.priority,  # stable: newest first inside a class
    )
    if not candidates:
        return []
    policy, sizes = pool.rule.policy, ask.sizes
    ends = [sum(sizes[: j + 1]) for j in range(len(sizes))]  # states of the first j + 1 requests
    asked = set(ask.request_ids)  # those already here (sent with the ask) count as asked, not twice

    def fits(num_paused: int, num_asked: int) -> bool:
        paused = {id(r) for unit in candidates[:num_paused] for r in unit}
        stay = [r for r in reqs if id(r) not in paused and r.id not in asked]
        view = BatchView(request_states(stay), pool.limits.max_total_tokens, pool.limits.running_max_req_size, policy)
        wanted = Candidate([ReqState(*s) for s in ask.states[: ends[num_asked - 1]]], policy)
        return view.ratio(wanted) is not None

    # Bisections (pausing more, or asking for fewer, never makes room scarcer): O(log n) checks
    # of O(n log n) each, not one per candidate, for a batch of a thousand requests.
    num_asked = _first(1, len(sizes) + 1, lambda j: not fits(len(candidates), j)) - 1
    if num_asked == 0:
        return []
    return [unit[0] for unit in candidates[: _first(0, len(candidates), lambda k: fits(k, num_asked))]]


def unasked_plan(pool: Pool, arrived: list[Req], max_preemptions: int) -> list[Req]:
    """``plan`` for requests that reached this worker without an ask, as if their router had sent one
    (``--preempt`` on the worker too). A router asks only when a request fits no worker by their
    records, and a record may be older than the work it admits against: a better class sent here on
    a record that showed room waited behind worse classes until they ended (the CI failure behind
    ``Group.joined``). One ask per pass, for the best class among the arrivals (in their order), and
    only when something here is worse: the cost of ``plan`` is paid when a pause is possible."""
    if not arrived:
        return []
    best = min(r.msg.priority for r in arrived)
    if not any(r.msg.priority > best for r in pool.requests()):
        return []
    msgs = [r.msg for r in arrived if r.msg.priority == best]
    ask = PreemptAsk.for_requests([m.id for m in msgs], best, [message_states(m) for m in msgs], asked_ms=0)
    return plan(pool, ask, max_preemptions)


def _first(low: int, high: int, holds: Callable[[int], bool]) -> int:
    """The least ``k`` in [low, high) for which ``holds`` (monotone: false, then true), else ``high``."""
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if holds(mid) else (mid + 1, high)
    return low


def samples_of(victim: Req, live: list[Req]) -> list[Req]:
    """What pausing ``victim`` takes out of ``live`` (the engine's running and waiting requests):
    its group's every sample still here, else ``victim`` alone."""
    if victim.group is None:
        return [victim]
    return [r for r in live if r.group is victim.group]


def kv_lost(samples: list[Req]) -> int:
    """K/V tokens a pause of ``samples`` throws away, to be computed again where they resume: each
    running sample's own, a forked group's shared prompt once. Call before their slots are freed."""
    running = [r for r in samples if r.phase is Phase.RUNNING]
    return max((r.num_shared for r in running), default=0) + sum(r.num_cached - r.num_shared for r in running)


def handed_back(samples: list[Req]) -> tuple[GenerateRequest, bool]:
    """The message a victim (one request, or a group's samples still here: ``samples_of``) goes
    back to the queue as, and whether its pause counts (it started: its prefill is lost). Call
    before the engine marks them finished."""
    first, group = samples[0], samples[0].group
    msg = first.msg if group is None else group.msg  # a group's as it came (a sample's has its own seed)
    if not any(r.phase is Phase.RUNNING or r.is_paused for r in samples):
        return msg, False  # never admitted here: it goes back as it came
    update: dict[str, object] = {"preemptions": msg.preemptions + 1}
    if group is None:
        update["resume_ids"] = list(first.output_ids)
    else:
        update |= _group_progress(group, samples)
    return msg.model_copy(update=update), True


def _group_progress(group: Group, samples: list[Req]) -> dict[str, object]:
    """Each choice's tokens so far and the choices that ended (before this attempt, or here): the
    fields of a requeued group (``shared.requeue.resume_fields``). Before its fork the leader stands
    for every open sample, with the tokens each had when it came."""
    emitted = [list(group.msg.emitted(c)) for c in range(group.size)]
    if group.forked:
        for req in samples:
            emitted[req.choice] = list(req.output_ids)
    for choice, ids in group.ended.items():
        emitted[choice] = list(ids)
    return {"group_resume": emitted, "finished_choices": sorted({*group.msg.finished_choices, *group.ended})}
