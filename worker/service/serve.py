"""The worker's service loop (rq's ``Worker.work`` shape).

inbox (block only when idle) -> cancels -> grammars -> engine.step() -> publisher.
The model loop never touches text, waits on Redis writes or compiles a
grammar: a constrained request waits in the engine's queue while its
grammar compiles on other threads (``worker.runner.grammar``), and when
nothing else is left the loop waits for that compile a little at a time,
reading its inbox in between. Tokens go to
the publisher process (``worker.service.publisher_process``), load records to the
heartbeat thread. If the publisher process dies, the worker hands its inbox
back and exits with an error (the launcher or the orchestrator restarts it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import redis

from shared.admission import AdmissionRule
from shared.codec import from_entry
from shared.keys import WORKER_GROUP
from shared.log_limit import LogLimiter
from shared.model_files import served_name
from shared.redis import OUTAGES, REDIS_FAILURES, Backoff
from shared.requeue import Death, hand_back_inbox, requeue
from shared.schemas import GenerateRequest
from shared.worker_load import WorkerLoad
from shared.worker_settings import WorkerSettings
from worker.engine.engine import Engine
from worker.engine.events import Event, Released
from worker.engine.load import build_load
from worker.lora.runtime import AdapterRuntime
from worker.service.heartbeat import Heartbeat
from worker.service.intake import ArrivalsMixin, Intake
from worker.service.publisher_process import PublisherDied, PublisherLink

if TYPE_CHECKING:
    from worker.runner.grammar import Grammars

log = logging.getLogger("lightq.worker")

IDLE_WAIT_S = 0.2  # an idle loop waits this long for an arrival
HELD_WAIT_S = 0.02  # only held requests left: the longest wait for a compile between two inbox reads


class WorkerService(ArrivalsMixin):
    """The loop, its drain and its hand-backs; what the intake read is taken in by ``ArrivalsMixin``
    (``worker.service.intake``)."""

    def __init__(
        self, settings: WorkerSettings, client: redis.Redis, engine: Engine, worker_id: str, publisher: PublisherLink
    ):
        self.settings = settings
        self.client = client
        self.engine = engine
        self.keys = settings.redis.keys
        self.worker_id = worker_id
        self.model = served_name(settings.model.model_dir, settings.model.served_model_name)  # its pool
        # The LoRA adapters it serves (--lora_modules': the worker does not start unless every one
        # loaded; run-time ones from the registry): the router sends a request naming one only to
        # workers whose record lists it.
        runner = getattr(engine, "runner", None)  # stand-in engines of tests have none
        self.lora = AdapterRuntime(
            getattr(runner, "adapters", None),
            getattr(runner, "model", None),
            settings.model.max_lora_rank,
            settings.model.adapter_names,
        )
        self.publisher = publisher  # started by the caller (it loads while the model does)
        # What one request may need here and surely start alone (the rule's, as the router's: from
        # the same settings): the record says it, and the producer checks requests against it.
        rule = AdmissionRule(settings.admission_rule)
        self.admission_limit = int(rule.policy.limit(engine.limits.max_total_tokens))
        self.heartbeat = Heartbeat(client, self.keys, worker_id, settings.heartbeat_s, self.load)
        self.stop_event = threading.Event()
        self.last_inbox_id = "0-0"
        self.intake = Intake(
            client,
            self.keys,
            worker_id,
            lambda: [req.id for req in engine.requests()],
            lambda: (engine.rule.history.window, engine.rule.settings.history_refresh_s),
            self.keys.lora_registry(self.model),
        )
        self._unstarted: list[tuple[GenerateRequest, str]] = []  # read while draining: going back
        self._backoff = Backoff()
        self._outage_log = LogLimiter(log)
        self.draining = False
        self.num_asks_read = 0  # preemption asks answered (the load record's preempt_asks_read)

    @property
    def grammars(self) -> Grammars | None:
        """The runner's grammars (None: this worker refuses constrained requests, its runner was
        built without a tokenizer)."""
        return getattr(self.engine.runner, "grammars", None)

    def load(self, seq: int) -> WorkerLoad:
        return build_load(
            self.engine,
            self.worker_id,
            seq,
            self.last_inbox_id,
            self.draining,
            self.model,
            self.settings.max_preemptions,
            self.num_asks_read,  # read before the engine is: a record with the count shows the pauses
            self.lora.view,
            self.admission_limit,
        )

    def run(self) -> None:
        """Serve until SIGTERM, then drain: no new requests, running ones get
        ``drain_timeout`` to finish, the rest goes back to the ingress stream."""
        self.publisher.wait_ready()
        self.intake.start()
        self.heartbeat.start()
        log.info("worker %s serving (pool %d tokens)", self.worker_id, self.engine.limits.max_total_tokens)
        death: Death | None = None  # a graceful stop hands back counted against nobody
        try:
            while not self.stop_event.is_set():
                self._serve_once()
            self._drain()
        except PublisherDied as exc:  # hand back below, then fail: the worker must not serve on
            log.error("worker %s: %s; handing its requests back and exiting", self.worker_id, exc)
            raise
        except Exception:  # a step raised: the death is blamed on that step's requests, and it exits
            blamed = frozenset(r.id for r in self.engine.suspects())
            death = Death(blamed=blamed, witnesses=blamed)
            log.exception(
                "worker %s: a step failed with %s in it; handing back and exiting", self.worker_id, sorted(blamed)
            )
            raise
        finally:
            self.intake.stop()  # nothing is read while the inbox goes back
            self.publisher.close()  # every token so far is in Redis before anything is handed back
            self._say_draining()
            self._hand_back(death)
            self.heartbeat.stop()
            log.info("worker %s stopped", self.worker_id)

    def _serve_once(self) -> None:
        """One turn of the loop: what the intake read (``worker.service.intake``: no Redis wait here
        unless idle), then a step; a Redis outage pauses intake, never running requests."""
        try:
            for found in self.intake.take(wait_s=None if self.engine.has_work else IDLE_WAIT_S):
                self._arrived(found)
            self._backoff.reset()
            self._outage_log.reset()
        except OUTAGES as exc:  # inline intake only (tests)
            self._outage_log.warning("Redis unreachable (%s)", exc)  # not once per step of an outage
            if not self.engine.has_work:
                time.sleep(self._backoff.next())
        if self.lora.pending:  # between two steps: no forward sees a slot change
            self._reconcile_adapters()
        self.publisher.check()
        grammars = self.grammars
        if grammars is not None:
            self._end_failed_grammars(grammars)
        if grammars is not None and self.engine.is_held_back:  # nothing to step until a grammar compiles
            grammars.wait(HELD_WAIT_S)
        elif self.engine.has_work:
            self._step()

    def _step(self) -> None:
        """One engine step; the prefill's events go to the publisher before the decode runs."""
        early: list[Event] = []

        def hand_over(events: list[Event]) -> None:
            early.extend(events)
            self.publisher.put(events)

        started = time.perf_counter()
        events = self.engine.step(hand_over)
        self.on_step([*early, *events], time.perf_counter() - started)
        if self.lora.refresh():  # an adapter paged in (another out): the routers prefer where it is now
            self.heartbeat.poke()
        self.publisher.put(events)
        if any(isinstance(e, Released) for e in events):
            self.heartbeat.poke()  # room freed: the routers hear of it now, not at the next period
        self._free_stopped()

    def on_step(self, events: list[Event], seconds: float) -> None:
        """Hook for metrics: one engine step took ``seconds`` and made ``events`` (its early ones too)."""

    def on_grammars(self, compile_seconds: list[float], num_failed: int) -> None:
        """Hook for metrics: compiles that finished (their seconds) and held requests ended since the
        last call (their constraint failed to compile, or timed out)."""

    def _end_failed_grammars(self, grammars: Grammars) -> None:
        """End the held requests whose constraint failed to compile or timed out: the error a request
        refused on arrival gets. The others wait on, in their places."""
        failed = grammars.failures() if grammars.held else []
        for req, error in failed:
            log.warning("%s: %s", req.id, error)
            self.publisher.put(self.engine.fail(req, error))
        compile_seconds = grammars.cache.take_compile_times()
        if failed or compile_seconds:
            self.on_grammars(compile_seconds, len(failed))
        if failed:
            self.heartbeat.poke()

    def _drain(self) -> None:
        self.draining = True
        self.heartbeat.beat()  # routers see ``draining`` now and stop dispatching here
        self._hand_back_unstarted()
        deadline = time.monotonic() + self.settings.drain_timeout
        log.info("worker %s draining: %d running", self.worker_id, len(self.engine.running))
        while self.engine.running and time.monotonic() < deadline:
            self._serve_once()

    def _say_draining(self) -> None:
        """The record says draining (routers send nothing more) before the inbox goes back: a
        failing worker's requests must not be dispatched to it again while it exits."""
        if self.draining:
            return
        self.draining = True
        try:
            self.heartbeat.beat()
        except REDIS_FAILURES as exc:  # the record expires on its own; the janitor reaps what comes
            log.warning("could not say draining (%s)", exc)

    def _hand_back_unstarted(self) -> None:
        """Requests queued here that never started go back to the ingress stream at once, not after
        the drain (another worker can start them now). Requeued before their inbox entry goes: a
        crash between the two requeues one twice at worst (a duplicate), never loses it."""
        unstarted = [(req.msg, req.inbox_id) for req in self.engine.take_unstarted()] + self._unstarted
        self._unstarted = []
        inbox = self.keys.inbox(self.worker_id)
        try:  # and what the inbox holds that this worker never read
            reply = self.client.xreadgroup(WORKER_GROUP, self.worker_id, {inbox: ">"}, count=100_000)
            unstarted += [
                (from_entry(GenerateRequest, fields), entry_id) for entry_id, fields in (reply[0][1] if reply else [])
            ]
            for msg, entry_id in unstarted:
                requeue(self.client, self.keys, msg, self.settings.redis.request_ttl_s, self.settings.max_attempts)
                pipe = self.client.pipeline(transaction=True)
                pipe.xack(inbox, WORKER_GROUP, entry_id)
                pipe.xdel(inbox, entry_id)
                pipe.execute()
        except REDIS_FAILURES as exc:  # those not requeued are still in the inbox: handed back at exit
            log.warning("handing back unstarted requests failed (%s): they go back at exit", exc)
        if unstarted:
            log.info("worker %s handed %d unstarted requests back", self.worker_id, len(unstarted))

    def _hand_back(self, death: Death | None = None) -> None:
        """Requeue what is still in our inbox (waiting, unfinished, or dispatched late); ``death``:
        this worker is failing, and says which requests it blames."""
        try:
            count = hand_back_inbox(
                self.client,
                self.keys,
                self.worker_id,
                self.settings.redis.request_ttl_s,
                self.settings.max_attempts,
                death,
            )
        except REDIS_FAILURES as exc:  # the router reaps our inbox once our record expires
            log.warning("hand-back failed (%s): the router will re-dispatch", exc)
            return
        if count:
            log.info("worker %s handed %d requests back", self.worker_id, count)

    def _free_stopped(self) -> None:
        """Requests the publisher ended on a stop string: free their slots now."""
        stopped = set(self.publisher.take_stopped())
        if stopped:
            for req in self.engine.requests():
                if (req.id, req.choice, req.epoch) in stopped:
                    self.publisher.put(self.engine.stop(req))
            self.heartbeat.poke()
