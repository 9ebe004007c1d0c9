"""The router's service loop: ingress stream -> admission -> a worker's inbox.

Entries are read through the ``routers`` consumer group and stay in this
router's pending list until dispatched: the inbox XADD, the status update
and the XACK happen in one script (``router.dispatch``), so a crash anywhere
before it leaves the entry pending (re-read with id 0 on restart) and a crash
after it leaves the request in exactly one inbox. The script writes only if
no other router dispatched to that worker since this one last looked;
otherwise this router learns those dispatches and decides again. Requests
are dispatched in the order of ``router.order.ordering`` (priority classes
strictly, fair shares of tokens between tenants inside a class, then
arrival), which lives in Redis so every router orders alike; a router reads
up to ``order_window`` entries of each class ahead to order them, from one
ingress stream per class (``shared.ingress``). When the head cannot be
placed, everything behind it waits too. The
output-length history past-future admission estimates from is re-read
from Redis every ``history_refresh_s``, not per request.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from router import liveness
from router.admission.views import Views
from router.admission.worker_view import cacheable_prompt
from router.dispatch import Dispatcher, Item
from router.intake import Intake
from router.lora.adapter_gone import adapter_gone
from router.order.ordering import OrderedQueue, clear_if_gone, forget, reserved_slots
from router.order.tenant_records import TenantRecords
from router.preempt import Preempter, heads
from router.workers.janitor import reap_dead_worker
from router.workers.registry import read_registry
from router.workers.reservations import Reservations
from shared import ingress
from shared.admission import AdmissionRule, request_states
from shared.batch_view import Candidate
from shared.config import CANCEL_CHECK_S, RouterSettings
from shared.keys import ROUTER_GROUP
from shared.log_limit import LogLimiter
from shared.lora import gone_error
from shared.redis import OUTAGES, REDIS_FAILURES, Backoff
from shared.request_log import end_request, now_ms
from shared.schemas import GenerateRequest, RequestStatus
from shared.worker_load import misfit, too_large_error

log = logging.getLogger("lightq.router")


class Router:
    def __init__(self, settings: RouterSettings, client: redis.Redis, router_id: str):
        self.settings = settings
        self.client = client
        self.keys = settings.redis.keys
        self.router_id = router_id
        self.reservations = Reservations()
        self.dispatcher = Dispatcher(client, self.keys)
        self.rule = AdmissionRule(settings.admission_rule)
        self._next_history_read = 0.0
        self.queue = OrderedQueue()
        self.intake = Intake(settings, client, router_id, self.queue)  # the ingress streams into the queue
        self.parking, self.tagger = self.intake.parking, self.intake.tagger
        self.tenant_records = TenantRecords(client, self.keys, settings.max_tenants)  # kept bounded
        self.stop_event = threading.Event()
        self._next_housekeeping = 0.0
        self._cancelled_ids: set[str] = set()  # queued requests found cancelled, until they end here
        self._next_cancel_check = 0.0
        # admissible workers, prepared for this step's decisions
        self.views = Views(self.rule.policy, cache_aware=settings.cache_aware)
        self.preempter = Preempter(client, self.keys) if settings.preempt else None  # router.preempt

    def run(self) -> None:
        """Step until stopped; ride out Redis outages with exponential backoff."""
        log.info("router %s reading %s[:PRIORITY]", self.router_id, self.keys.requests())
        backoff = Backoff()
        outage_log = LogLimiter(log)  # an outage is one line every few seconds, not one per retry
        try:
            while not self.stop_event.is_set():
                try:
                    self.step()
                    backoff.reset()
                    outage_log.reset()
                except OUTAGES as exc:
                    outage_log.warning("Redis unreachable (%s): retrying in %.1f s", exc, backoff.delay)
                    self.stop_event.wait(backoff.next())
        finally:
            with contextlib.suppress(*REDIS_FAILURES):  # entries we hold become claimable by others at once
                liveness.forget(self.client, self.keys, self.router_id)

    def step(self) -> int:
        """Read, reap, dispatch; returns how many requests were dispatched."""
        self._housekeeping()
        self.intake.read()
        registry = read_registry(self.client, self.keys, int(self.settings.stale_load_s * 1000))
        for worker_id in registry.dead:
            reap_dead_worker(
                self.client, self.keys, worker_id, self.settings.redis.request_ttl_s, self.settings.max_attempts
            )
        self.reservations.settle(registry.live)
        self._refresh_history()
        loads = registry.admissible()
        self.views.refresh(loads, self.reservations.pending())
        self.intake.unpark()
        dispatched = self._dispatch(loads)
        if self.queue and not dispatched:
            self.stop_event.wait(self.settings.poll_ms / 1000)
        return dispatched

    def _housekeeping(self) -> None:
        """Once per liveness period: say we are alive, drop fair-share records that change no tag
        any more (``router.order.tenant_records``), take over dead routers' entries.

        Also recreates the consumer group if Redis lost it (a restart without persistence).
        """
        now = time.monotonic()
        if now < self._next_housekeeping:
            return
        self._next_housekeeping = now + self.settings.liveness_ttl_s / 3
        self.intake.ensure_groups()
        liveness.beat(self.client, self.keys, self.router_id, self.settings.liveness_ttl_s)
        self.tenant_records.compact()
        for priority, entries in liveness.claim_from_dead_routers(self.client, self.keys, self.router_id):
            self.intake.take(priority, entries)

    def _refresh_history(self) -> None:
        now = time.monotonic()
        if now < self._next_history_read:
            return
        self._next_history_read = now + self.settings.admission_rule.history_refresh_s
        self.rule.learn(self.client.lrange(self.keys.output_lengths(), 0, self.rule.history.window - 1))
        self.views.clear()  # their draws came from the old history

    def _dispatch(self, loads) -> int:
        loads = dict(loads)  # a worker found dead while dispatching leaves this step's choice
        cancelled, dispatched = self._cancelled(), 0
        while self.queue:
            run = self._decide(cancelled, loads)
            if not run:
                break
            sent, behind = self._send(run, loads)
            if self.preempter is not None:
                self.preempter.flush()  # asks after the requests they make room for (router.preempt)
            dispatched += sent
            if behind is not None:  # a better class waits (maybe at another router): this one waits too
                clear_if_gone(self.client, self.keys, *behind)
                break
        return dispatched

    def _decide(self, cancelled: set[str], loads: dict) -> list[Item]:
        """Decisions for the head of the queue, in order, until one must wait (with ``--preempt``,
        a worker running a worse class is asked to make room for it: ``router.preempt``)."""
        run: list[Item] = []
        while self.queue and len(run) < self.settings.dispatch_batch:
            entry_id, request = self.queue[0]
            expired = request.expired(now_ms())
            if request.id in cancelled or expired:
                status = RequestStatus.CANCELLED if request.id in cancelled else RequestStatus.EXPIRED
                self._finish(entry_id, request, status, status.value)
                self._cancelled_ids.discard(request.id)
                self._pop()
                continue
            started = time.perf_counter()
            worker_id = self._choose(request)
            self.on_decision(request, worker_id, time.perf_counter() - started)
            if worker_id is None and adapter_gone(self.client, self.keys, request, loads):
                # unloaded while it waited: no worker will ever take it (router.lora.adapter_gone)
                error = gone_error(request.adapter or "", started=request.has_output)
                self._finish(entry_id, request, RequestStatus.FAILED, "error", error)
                self._pop()
                continue
            if worker_id is None and self.views.fits_nowhere(request, request_states(request)):
                # no live worker could start it even empty: it would hold its class's queue for ever
                why = misfit(request, list(loads.values())) or (
                    f"its KV tokens (up to {request.max_tokens_needed}) are over what admission lets any worker's "
                    "pool take: lower max_tokens or n"
                )
                self._finish(entry_id, request, RequestStatus.FAILED, "error", too_large_error(why))
                self._pop()
                continue
            if worker_id is None:
                run += self._preempt_for(loads)
                break
            run.append(Item(worker_id, self.reservations.tail(worker_id), entry_id, request))
            self.queue.popleft()
        return run

    def _preempt_for(self, loads: dict) -> list[Item]:
        """``--preempt``: the head fits no worker; ask one running a worse class to make room for
        it and those like it right behind (``router.preempt``), and send them there now, so the
        worker pauses and admits them in one turn instead of waiting for its record to say so."""
        if self.preempter is None:
            return []
        waiting = heads(self.queue)
        asked = self.preempter.ask(waiting, loads, self.reservations.preemptible(loads))
        if asked is None:
            return []
        target, count = asked
        items = []
        for request in waiting[:count]:
            entry_id, _ = self.queue.popleft()
            self.views.admit(target, Candidate(request_states(request), self.rule.policy))
            items.append(Item(target, self.reservations.tail(target), entry_id, request))
        return items

    def _send(self, run: list[Item], loads: dict) -> tuple[int, tuple[str, str | None] | None]:
        """The run in one round trip; what was not written goes back to its place. Also returns the
        request of a better class that blocked the run, if one did."""
        back, rebuild, behind = [], set(), None
        for item, outcome in zip(run, self.dispatcher.send_many(run)):
            if outcome.inbox_id is not None:
                self.reservations.add(item.worker_id, outcome.inbox_id, item.request)
                self.intake.queued_ids.discard(item.entry_id)
                self.queue.drop(item.entry_id)
                continue
            if outcome.duplicate:  # a copy of a request an inbox holds: gone, and not counted anywhere
                log.warning("%s is in an inbox already: a second entry of it was dropped", item.request.id)
                self.intake.queued_ids.discard(item.entry_id)
                self.queue.drop(item.entry_id)
                rebuild.add(item.worker_id)
                continue
            if outcome.behind is not None and behind is None:  # the waiting request, and its model's set
                behind = (outcome.behind, item.request.model)
            back.append((item.entry_id, item.request))  # another router got there first, or the worker died
            rebuild.add(item.worker_id)
            if outcome.newer is None:
                loads.pop(item.worker_id, None)
            else:
                self.reservations.learn(item.worker_id, outcome.newer)
        self.queue.put_back(back)
        self.views.refresh(loads, self.reservations.pending(), rebuild)  # undo what was counted in vain
        return len(run) - len(back), behind

    def _pop(self) -> None:
        entry_id, _ = self.queue.popleft()
        self.queue.drop(entry_id)
        self.intake.queued_ids.discard(entry_id)

    def _cancelled(self) -> set[str]:
        """Queued requests whose client cancelled them, looked up in one round trip at most every
        ``CANCEL_CHECK_S`` (a step can take a millisecond; a request cancelled since the last look
        is still stopped by its worker, which checks cancels every step). At each look, those and
        the ones past their deadline end wherever they wait (``_end_waiting``)."""
        now = time.monotonic()
        if now >= self._next_cancel_check:
            self._next_cancel_check = now + CANCEL_CHECK_S
            # One MGET, not a command per request: the queue holds up to ``order_window`` of them.
            ids = [request.id for _, request in self.queue]
            if ids:
                hits = self.client.mget([self.keys.cancel(i) for i in ids])
                self._cancelled_ids.update(i for i, hit in zip(ids, hits) if hit is not None)
            self._end_waiting()
        return self._cancelled_ids

    def _end_waiting(self) -> None:
        """Cancelled and expired requests end now, not when they reach the head: behind requests
        that wait for room, a cancelled stream stayed open and a 0.5 s timeout ended after 21 s."""
        at = now_ms()
        ending = [
            (entry_id, request)
            for entry_id, request in self.queue
            if request.id in self._cancelled_ids or request.expired(at)
        ]
        if not ending:
            return
        self.queue.remove({entry_id for entry_id, _ in ending})
        for entry_id, request in ending:
            status = RequestStatus.CANCELLED if request.id in self._cancelled_ids else RequestStatus.EXPIRED
            self._finish(entry_id, request, status, status.value)
            self._cancelled_ids.discard(request.id)
            self.intake.queued_ids.discard(entry_id)

    def _choose(self, request: GenerateRequest) -> str | None:
        """A worker for the request (a group: all its samples, the prompt once), counted on its
        view at once (the next decision sees it)."""
        candidate = Candidate(request_states(request), self.rule.policy)
        # A request below the default class is checked with the reserved slots taken (router.order.ordering).
        reserve = reserved_slots(self.settings.priority_reserve_slots if request.priority > 0 else 0)
        checked = Candidate(request_states(request) + reserve, self.rule.policy) if reserve else candidate
        prompt = cacheable_prompt(request)
        worker_id = self.views.choose(checked, request.model, prompt, request.adapter, request.brings_adapter)
        if worker_id is not None:
            self.views.admit(worker_id, candidate)
        return worker_id

    def on_decision(self, request: GenerateRequest, worker_id: str | None, seconds: float) -> None:
        """Hook for metrics: one admission decision (worker None: the request waits)."""

    def on_finish(self, request: GenerateRequest, status: RequestStatus) -> None:
        """Hook for metrics: a request ended here without reaching a worker."""

    def _finish(
        self, entry_id: str, request: GenerateRequest, status: RequestStatus, reason, error: str | None = None
    ) -> None:
        """End a request that never reached a worker (cancelled, past its deadline, its adapter gone,
        too large for every worker)."""
        end_request(  # fenced: refused if it ended meanwhile; acknowledged either way
            self.client,
            self.keys,
            request.id,
            status=status,
            reason=reason,
            num_output=request.num_emitted,
            ttl_s=self.settings.redis.request_ttl_s,
            error=error,
        )
        pipe = self.client.pipeline(transaction=True)
        stream, raw_id = ingress.locate(self.keys, entry_id)  # the stream it was read from
        pipe.xack(stream, ROUTER_GROUP, raw_id)
        forget(pipe, self.keys, request)
        pipe.execute()
        self.on_finish(request, status)
