"""The worker's load record: what the router's admission check reads.

Besides the pool totals it lists, for every running or waiting request, the
``ReqState`` summary [prompt + output tokens, output tokens, max_new_tokens,
ignore_eos] from which the router estimates each request's remaining
length and the batch's peak (router.admission.worker_view, shared.batch_view). A waiting request is
listed with the tokens it will hold once prefilled: the peak counts them
from the start. A group counts its prompt once (``shared.peak.group_states``):
before its fork as a state per open sample (a requeued group's finished
ones left out, the tokens each emitted held and generated), after it with
the prompt on the first member still sharing it. Runs on the heartbeat
thread while the model loop changes the engine's lists, so it reads a copy
and tolerates a request appearing in both lists for an instant (it is
listed once).

A cached prefix several requests lease (``worker.engine.radix_cache``) is
counted once too, with the first of them, node by node of its path (a
request admitted with a hit adds only the rest: ``Admission.adds``); a split
on the model loop can make one record count a few tokens twice, never lose
them. The record also carries what the cache holds (``prefixes``) for the
router's cache-aware choice, which of those prefixes the listed requests hold
(``held_prefixes``: a request starting with one adds only the rest, as
``Admission.adds`` counts it), and the cache's counters for the dashboard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from shared.admission import request_states as message_states
from shared.lora import AdapterView
from shared.peak import ReqState
from shared.request_log import now_ms
from shared.worker_load import WorkerLoad, tally_preemptible
from worker.engine.kv_slots import CacheStats
from worker.engine.radix_cache import Lease, held_hashes, lease_path
from worker.engine.request import Phase, Req, by_request


@dataclass(frozen=True)
class LoadSnapshot:
    used_tokens: int
    committed_tokens: int
    num_running: int
    num_waiting: int
    cache: CacheStats = CacheStats()
    prefixes: tuple[tuple[int, int], ...] = ()  # the cache's summary (KVSlots.summary)


class Limits(Protocol):
    @property
    def max_total_tokens(self) -> int: ...
    @property
    def running_max_req_size(self) -> int: ...


class LoadSource(Protocol):
    """What the record is read from: ``worker.engine.engine.Engine``, on the heartbeat thread."""

    @property
    def limits(self) -> Limits: ...
    def snapshot(self) -> LoadSnapshot: ...
    def requests(self) -> list[Req]: ...

    num_preempted: int  # started requests paused for a better class, since start
    num_preempted_tokens: int  # their K/V tokens, computed again where they resume


def request_states(reqs: list[Req]) -> list[ReqState]:
    """One state per sample; each group's shared prompt counted once."""
    seen: set[int] = set()
    carried: set[int] = set()  # groups whose shared prompt is already counted
    counted: set[int] = set()  # cache nodes whose tokens are already counted
    states: list[ReqState] = []
    for req in reqs:
        if id(req) in seen or req.phase is Phase.FINISHED:
            continue
        seen.add(id(req))
        params = req.msg.params
        group = req.counted_group
        if group is not None:  # every open sample, as the router counted the group's message
            first, *rest = message_states(group.msg)
            states += [first._replace(held=first.held - _counted_before(req.lease, counted)), *rest]
            continue
        held = req.num_tokens - _counted_before(req.lease, counted)
        if req.num_shared and req.group is not None:  # a member reading the group's prompt: counted once
            if id(req.group) in carried:
                held -= req.num_shared
            else:
                held -= _counted_before(req.group.lease, counted)
            carried.add(id(req.group))
        states.append(ReqState(held, len(req.output_ids), params.max_new_tokens, int(params.ignore_eos)))
    return states


def _counted_before(lease: Lease | None, counted: set[int]) -> int:
    """Tokens of the lease's path already counted with an earlier request; the rest is now."""
    before = 0
    for node, tokens in lease_path(lease):
        if node in counted:
            before += tokens
        counted.add(node)
    return before


def preemptible_classes(reqs: list[Req], max_preemptions: int) -> list[tuple[int, int, int]]:
    """[priority, tokens held, request slots] per class with requests a better class may pause
    (``worker.engine.preempt``), the worst class first: what a router picks the worker to ask by,
    and how many requests it may send there with an ask (a pause frees one request slot, a group's
    one per open sample, its prompt counted once: as ``request_states`` counts it)."""
    units = by_request(r for r in reqs if r.can_preempt(max_preemptions))
    held = [(unit[0].msg.priority, request_states(unit)) for unit in units]
    return tally_preemptible((priority, sum(s.held for s in states), len(states)) for priority, states in held)


NO_ADAPTERS = AdapterView()  # a worker without LoRA adapters


def build_load(
    engine: LoadSource,
    worker_id: str,
    seq: int,
    last_inbox_id: str,
    draining: bool = False,
    model: str | None = None,
    max_preemptions: int = 0,
    preempt_asks_read: int = 0,
    lora: AdapterView = NO_ADAPTERS,
    admission_limit: int | None = None,
) -> WorkerLoad:
    snap = engine.snapshot()
    reqs = engine.requests()
    states = request_states(reqs)
    # After the states, from the same requests: a lease let go of since is missing (the router
    # counts that prefix again), never one the states do not count.
    held_prefixes = _held_prefixes(reqs, snap.prefixes)
    return WorkerLoad(
        worker_id=worker_id,
        seq=seq,
        ts_ms=now_ms(),
        max_total_tokens=engine.limits.max_total_tokens,
        used_tokens=snap.used_tokens,
        committed_tokens=snap.committed_tokens,
        num_running=snap.num_running,
        num_waiting=snap.num_waiting,
        last_inbox_id=last_inbox_id,
        draining=draining,
        model=model,
        adapters=list(lora.serving),
        resident_adapters=list(lora.resident),
        lora_failed=list(lora.failed),
        adopts_adapters=lora.adopts,
        running_max_req_size=engine.limits.running_max_req_size,
        admission_limit=admission_limit,
        requests=[(s.held, s.generated, s.max_new_tokens, s.ignore_eos) for s in states],
        preemptible=preemptible_classes(reqs, max_preemptions),
        max_preemptions=max_preemptions,
        preempt_asks_read=preempt_asks_read,
        preempted_requests=engine.num_preempted,
        preempted_kv_tokens=engine.num_preempted_tokens,
        prefix_cache=snap.cache.enabled,
        cached_tokens=snap.cache.cached,
        prefixes=list(snap.prefixes),
        held_prefixes=held_prefixes,
        prefix_asked_tokens=snap.cache.asked,
        prefix_hit_tokens=snap.cache.hit,
        prefix_evicted_tokens=snap.cache.evicted,
    )


def _held_prefixes(reqs: list[Req], prefixes: tuple[tuple[int, int], ...]) -> list[int]:
    """Which of the cache's ``prefixes`` (their indices) the unfinished requests or their groups lease."""
    live = [req for req in reqs if req.phase is not Phase.FINISHED]  # as request_states counts them
    held = held_hashes(lease for req in live for lease in (req.lease, req.group.lease if req.group else None))
    return [i for i, (h, _) in enumerate(prefixes) if h in held]
