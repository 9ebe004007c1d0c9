"""The continuous-batching engine: add, cancel, step.

A step decodes one token for every prefilled request (one forward, a CUDA
graph on GPU) and prefills prompt chunks of at most ``batch_max_tokens``
tokens in total (a second forward), so a long prompt is spread over steps
and never stalls everyone's decode. Admission is the worker's own check on
its pool, by the same rule and checker the router applies
(``worker.engine.admission``). When an estimate was wrong and
the pool cannot hold this step's tokens, the newest running request is
paused: its slots are freed and it waits at the head of the queue with its
output kept, to be prefilled again (prompt + output) and continue.
Finished and cancelled requests free their slots at once. A waiting request
is load whether or not it can start yet (the load record lists every one).

A group (n samples of one prompt, ``worker.engine.request``) is admitted whole,
its prompt counted once (``worker.engine.load.request_states``); its leader
prefills the prompt and the step that completes it forks the other samples,
which share the prompt's slots. From then on each sample is a request of
its own here: it decodes, finishes, is cancelled or paused for room alone (a
paused sample lets go of the shared prompt and is prefilled again on its own
copy, simpler than pausing whole groups and as correct); a pause for a
better class (``preempt``) takes the whole group back to the queue. The inbox entry is
released with the group's last sample. A requeued group forks only its
unfinished samples, and one that had emitted tokens is prefilled after
them on top of the shared prompt before it samples again
(``worker.engine.request``).

With the prefix cache on (``worker.engine.radix_cache``, ``worker.engine.kv_slots``)
an admitted request starts after the longest cached prefix of its ids, and
ended, cancelled and paused requests leave their tokens in the tree, which
gives unreferenced ones back only when a step needs their slots. So the
room a step has is the free slots plus the evictable cached ones, and
admission counts only what a request adds (``Admission.adds``). A paused
request is resumed from whatever of its tokens the tree still holds.

With ``overlap`` (on a GPU by default, ``--overlap``) the host prepares a step
while the device runs the one before: a decode step is launched (its forward
reads each request's last sampled id where the sampler left it, on the
device), then the previous decode's tokens land (the host waits for them, the
device having the new forward queued), then the new step's sampling is queued
(after the landing, so grammar masks and sampling parameters see every token
so far). So the host learns a token one step after it was sampled, and
finds an end by EOS, grammar or stop string one step late: the request fed
one more token, whose K/V and sample are thrown away (``num_discarded``),
never published. Ends known in advance (``max_new_tokens``) cost nothing.
Cancels, stop strings and preemptions between steps simply mark the request
finished; its token in flight is dropped when it lands. A pause needs every
token landed first (``step`` lands the step in flight before pausing), since
the paused request is prefilled again from its output. Invariant: at most
one decode is in flight, and it lands in the next ``step`` or ``flush``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from shared.admission import AdmissionRule
from shared.schemas import RequestStatus
from worker.engine.admission import Admission, EngineLimits, Starter, slots_needed
from worker.engine.events import Ended, Event, Preempted, Started
from worker.engine.forwards import Forwards, Launched, Launcher
from worker.engine.load import LoadSnapshot, request_states
from worker.engine.preempt import handed_back, kv_lost, samples_of
from worker.engine.request import Phase, Req
from worker.engine.token_pool import TokenPool

if TYPE_CHECKING:  # the engine itself stays free of torch
    from worker.runner.model_runner import DecodeForward
    from worker.runner.sampler import PendingSampled

log = logging.getLogger("lightq.worker")


class Runner(Starter, Launcher, Protocol):
    """What the engine asks of ``worker.runner.model_runner.ModelRunner``: the pool's slots, a table
    row per request, and the forwards, each queued on the device (nothing waits until the engine
    lands its ``PendingSampled``)."""

    pool: TokenPool

    def queued(self, req: Req) -> None: ...
    def forward_decode(self, reqs: list[Req], ids_known: bool = True) -> DecodeForward: ...
    def sample_decode(self, launched: DecodeForward) -> PendingSampled: ...


class Engine(Forwards):
    """A step's forwards, from launch to landing, and the release of the requests that end: ``Forwards``."""

    runner: Runner

    def __init__(
        self, runner: Runner, limits: EngineLimits, eos_ids: set[int], rule: AdmissionRule, overlap: bool = False
    ):
        self.runner = runner
        self.limits = limits
        self.eos_ids = eos_ids
        self.admission = Admission(runner, limits, rule)
        # Land each decode's tokens in the next step, after its forward is launched (module docstring).
        self.overlap = overlap
        self._in_flight: Launched | None = None  # the decode whose tokens have not landed
        # The requests of the forwards under way (launched, their tokens not landed yet): those a
        # failing step is blamed on (``suspects``).
        self._prefilling: list[Req] = []
        self._decoding_now: list[Req] = []
        # Tokens sampled for requests that had ended before they landed (overlap: found a step late).
        self.num_discarded = 0
        self.num_pauses = 0
        # Pauses for a better class (``preempt``) and the KV tokens they threw away (to recompute).
        self.num_preempted = 0
        self.num_preempted_tokens = 0
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._lock = threading.Lock()  # guards what the heartbeat thread reads

    @property
    def rule(self) -> AdmissionRule:
        """The router's rule, from the same settings (shared.admission): admission's."""
        return self.admission.rule

    @rule.setter
    def rule(self, rule: AdmissionRule) -> None:
        self.admission.rule = rule

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight)

    @property
    def is_held_back(self) -> bool:
        """Nothing runs or is in flight and the runner can start none of the waiting requests (their
        grammars compile): a step would do nothing until one can."""
        if self.running or self._in_flight or not self.waiting:
            return False
        return not any(self.runner.prepare(r) for r in self.waiting)

    def take_unstarted(self) -> list[Req]:
        """Remove and return the waiting requests that never started here (no events were sent
        for them; a paused one has, and stays). They are finished here (handed back)."""
        with self._lock:
            unstarted = [r for r in self.waiting if not r.is_paused]
            self.waiting = deque(r for r in self.waiting if r.is_paused)
            for req in unstarted:
                req.phase = Phase.FINISHED
        return unstarted

    def add(self, req: Req) -> None:
        """Queue ``req`` behind the waiting requests of its priority class and better ones, ahead of
        worse ones (a class-0 request the router sent with a preemption ask must not start after
        class-1 requests queued here before it); what it needs to start (its grammar) is prepared
        from now on, off the loop. One class: arrival order, and O(1)."""
        with self._lock:
            at = len(self.waiting)
            while at > 0 and self.waiting[at - 1].msg.priority > req.msg.priority:
                at -= 1
            self.waiting.insert(at, req)
        self.runner.queued(req)

    def requests(self) -> list[Req]:
        with self._lock:
            return [*self.running, *self.waiting]

    def snapshot(self) -> LoadSnapshot:
        with self._lock:
            # committed: prompt + max_new_tokens of every sample, each group's prompt once
            committed = sum(s.conservative_need for s in request_states([*self.running, *self.waiting]))
            slots = self.runner.slots
            return LoadSnapshot(
                slots.num_held,
                committed,
                len(self.running),
                len(self.waiting),
                slots.stats(),
                slots.summary,
            )

    def cancel(self, req: Req) -> list[Event]:
        """End ``req`` now (wherever it is) and free its slots; an unforked group ends every sample."""
        if req.phase is Phase.FINISHED:
            return []
        group = req.unforked_group
        if group is not None:  # it stands for every open sample, each after its emitted tokens
            ends = [(c, len(group.msg.emitted(c))) for c in group.msg.open_choices]
        else:
            ends = [(req.choice, len(req.output_ids))]
        events: list[Event] = [
            Ended(req.id, RequestStatus.CANCELLED, "cancelled", num, choice=c, epoch=req.epoch) for c, num in ends
        ]
        return events + self._release(req, "cancelled")

    def fail(self, req: Req, error: str) -> list[Event]:
        """End waiting ``req`` with ``error`` (its grammar could not be compiled here): the events of a
        request the service refused on arrival."""
        if req.phase is not Phase.WAITING:
            return []
        ended = Ended(req.id, RequestStatus.FAILED, "error", req.msg.num_emitted, error, epoch=req.epoch)
        return [ended, *self._release(req, "error")]

    def stop(self, req: Req) -> list[Event]:
        """End ``req``, which the publisher found a stop string in (it wrote the end)."""
        if req.phase is Phase.FINISHED:
            return []
        return self._release(req, "stop")

    def preempt(self, victims: list[Req]) -> list[Event]:
        """Take ``victims`` (``worker.engine.preempt.plan``) out now, their slots freed, a group's
        every sample with any of them; each goes back to the queue with its output as resume state
        (the publisher writes it after its tokens). Call between steps."""
        events: list[Event] = []
        with self._lock:
            for victim in victims:
                if victim.phase is Phase.FINISHED:  # a group's sample, taken out with another
                    continue
                samples = samples_of(victim, [*self.running, *self.waiting])
                msg, counts = handed_back(samples)
                self.num_preempted_tokens += kv_lost(samples)
                for req in samples:
                    self._take_out(req)
                self.num_preempted += counts
                events.append(Preempted(victim.id, victim.inbox_id, msg, victim.epoch))
        return events

    def step(self, early: Callable[[list[Event]], None] | None = None) -> list[Event]:
        """Admit, prefill, decode, and land what the device sampled; the events are returned.

        The prefill goes first. Without overlap, ``early`` (if given) gets its events (admissions,
        first tokens) before the decode runs, so a new request's first token does not wait for the
        decode forward, and the decode's tokens land before this returns. With overlap the decode's
        tokens land in the next call, between its forward's launch and its sampling: the host
        prepares a step while the device runs the last one (the module docstring says what that
        costs). A prefill's tokens land in the call that launched them either way."""
        events: list[Event] = [Started(r.msg, r.taken_ms, r.epoch) for r in self._admit() if not r.is_paused]
        if events and early is not None:
            # Before their first forward: if it kills this worker, they were running here (their
            # status says so), and the death is counted against them (shared.requeue).
            early(events)
            events = []
        for req in self.running:
            req.is_paused = False
        decoding = self._decoding()  # before the prefill: it samples its own
        if self.runner.slots.available < slots_needed(self.running, decoding):
            events += self.flush()  # the requests its tokens end free slots: maybe no pause is needed
            self._pause_overflow()
            decoding = self._decoding()
        chunks = self.admission.prefill_chunks(self.running, len(decoding))
        self._prefilling = [r for r, _ in chunks]
        prefill = self._launch_prefill(chunks) if chunks else None
        if prefill is not None and not self.overlap:
            events += self._land(prefill)
            prefill = None
            self._prefilling = []
            if decoding and early is not None and events:
                early(events)
                events = []
        if decoding:
            self._decoding_now = decoding
            launched = self.runner.forward_decode(decoding, ids_known=self._in_flight is None)
            events += self.flush()  # before the sampling: grammars advance on these tokens
            self._in_flight = Launched(decoding, self.runner.sample_decode(launched))
            self._decoding_now = []
        else:
            events += self.flush()
        if prefill is not None:
            events += self._land(prefill)
            self._prefilling = []
        if not self.overlap:
            events += self.flush()
        self.runner.slots.refresh_summary(idle=not self.has_work)  # on this thread: the tree is not thread-safe
        return events

    def _admit(self) -> list[Req]:
        """Start what the rule allows of the waiting requests (``worker.engine.admission``)."""
        if not self.waiting:  # most steps: nothing to admit, so no O(batch) summary either
            return []  # (read without the lock: one added meanwhile waits a step)
        with self._lock:
            return self.admission.admit(self.waiting, self.running)

    def _pause_overflow(self) -> None:
        """Free slots for this step's tokens by pausing the newest requests (an estimate was wrong).
        Nothing is in flight (the caller landed it), so a paused request has no token on its way."""
        while self.runner.slots.available < slots_needed(self.running, self._decoding()) and len(self.running) > 1:
            victim = self.running[-1]
            with self._lock:
                self.running.pop()
                self.runner.finish(victim)
                victim.phase, victim.is_prefilled, victim.is_paused = Phase.WAITING, False, True
                self.waiting.appendleft(victim)
            self.num_pauses += 1
            log.info(
                "paused %s (%d tokens out) to free KV slots: an estimate was short", victim.id, len(victim.output_ids)
            )
