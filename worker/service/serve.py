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

from shared.codec import decode, from_entry
from shared.config import CANCEL_CHECK_S, WorkerSettings
from shared.keys import WORKER_GROUP
from shared.log_limit import LogLimiter
from shared.model_files import served_name
from shared.redis import Backoff, ensure_group
from shared.requeue import hand_back_inbox, requeue
from shared.schemas import GenerateRequest, PreemptAsk, RequestStatus, WorkerLoad
from worker.engine.engine import Engine
from worker.engine.events import Ended, Event, Released
from worker.engine.load import build_load
from worker.engine.preempt import plan
from worker.engine.request import Req
from worker.service.heartbeat import Heartbeat
from worker.service.publisher_process import PublisherDied, PublisherLink

if TYPE_CHECKING:
    from worker.runner.grammar import Grammars

log = logging.getLogger("lightq.worker")

IDLE_BLOCK_MS = 200
HELD_WAIT_S = 0.02  # only held requests left: the longest wait for a compile between two inbox reads


class WorkerService:
    def __init__(
        self, settings: WorkerSettings, client: redis.Redis, engine: Engine, worker_id: str, publisher: PublisherLink
    ):
        self.settings = settings
        self.client = client
        self.engine = engine
        self.keys = settings.redis.keys
        self.worker_id = worker_id
        self.model = served_name(settings.model.model_dir, settings.model.served_model_name)  # its pool
        self.publisher = publisher  # started by the caller (it loads while the model does)
        self.heartbeat = Heartbeat(client, self.keys, worker_id, settings.heartbeat_s, self.load)
        self.stop_event = threading.Event()
        self.last_inbox_id = "0-0"
        self._read_id = "0"  # our own pending entries first, then new ones
        self._next_cancel_check = 0.0
        self._next_history_read = 0.0
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
        )

    def run(self) -> None:
        """Serve until SIGTERM, then drain: no new requests, running ones get
        ``drain_timeout`` to finish, the rest goes back to the ingress stream."""
        self.heartbeat.start()
        log.info("worker %s serving (pool %d tokens)", self.worker_id, self.engine.limits.max_total_tokens)
        try:
            while not self.stop_event.is_set():
                self._serve_once()
            self._drain()
        except PublisherDied as exc:  # hand back below, then fail: the worker must not serve on
            log.error("worker %s: %s; handing its requests back and exiting", self.worker_id, exc)
            raise
        finally:
            self.publisher.close()  # every token so far is in Redis before anything is handed back
            self._hand_back()
            self.heartbeat.stop()
            log.info("worker %s stopped", self.worker_id)

    def _serve_once(self) -> None:
        """One turn of the loop; a Redis outage pauses intake, never running requests."""
        try:
            if not self.draining:
                self._read_inbox()
            self._check_cancels()
            self._refresh_history()
            self._backoff.reset()
            self._outage_log.reset()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            self._outage_log.warning("Redis unreachable (%s)", exc)  # not once per step of an outage
            if not self.engine.has_work:
                time.sleep(self._backoff.next())
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._read_id = "0"  # Redis lost our inbox group (restarted empty): recreate it
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

    def _hand_back_unstarted(self) -> None:
        """Requests queued here that never started go back to the ingress stream at once, not after
        the drain (another worker can start them now). Requeued before their inbox entry goes: a
        crash between the two requeues one twice at worst (a duplicate), never loses it."""
        unstarted = [(req.msg, req.inbox_id) for req in self.engine.take_unstarted()]
        inbox = self.keys.inbox(self.worker_id)
        try:  # and what the inbox holds that this worker never read
            reply = self.client.xreadgroup(WORKER_GROUP, self.worker_id, {inbox: ">"}, count=100_000)
            unstarted += [
                (from_entry(GenerateRequest, fields), entry_id) for entry_id, fields in (reply[0][1] if reply else [])
            ]
            for msg, entry_id in unstarted:
                requeue(
                    self.client,
                    self.keys,
                    msg,
                    self.settings.redis.request_ttl_s,
                    self.settings.max_attempts,
                    count_attempt=False,
                )
                pipe = self.client.pipeline(transaction=True)
                pipe.xack(inbox, WORKER_GROUP, entry_id)
                pipe.xdel(inbox, entry_id)
                pipe.execute()
        except redis.RedisError as exc:  # those not requeued are still in the inbox: handed back at exit
            log.warning("handing back unstarted requests failed (%s): they go back at exit", exc)
        if unstarted:
            log.info("worker %s handed %d unstarted requests back", self.worker_id, len(unstarted))

    def _hand_back(self) -> None:
        """Requeue what is still in our inbox (waiting, unfinished, or dispatched late)."""
        try:
            count = hand_back_inbox(
                self.client,
                self.keys,
                self.worker_id,
                self.settings.redis.request_ttl_s,
                self.settings.max_attempts,
                count_attempt=False,
            )
        except redis.RedisError as exc:  # the router reaps our inbox once our record expires
            log.warning("hand-back failed (%s): the router will re-dispatch", exc)
            return
        if count:
            log.info("worker %s handed %d requests back", self.worker_id, count)

    def _read_inbox(self) -> None:
        if self._read_id == "0":  # first turn, or after a Redis restart lost the group
            ensure_group(self.client, self.keys.inbox(self.worker_id), WORKER_GROUP)
        block = None if self.engine.has_work or self._read_id == "0" else IDLE_BLOCK_MS
        inbox, asks = self.keys.inbox(self.worker_id), self.keys.preempt(self.worker_id)
        # With work here, the routers' preemption asks come in the same round trip (read and
        # deleted at once); an idle worker has nothing to pause, and an ask expires on its own.
        if block is None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xreadgroup(WORKER_GROUP, self.worker_id, {inbox: self._read_id}, count=1024)
            pipe.lrange(asks, 0, -1)
            pipe.delete(asks)
            reply, raw_asks, _ = pipe.execute()
        else:
            reply = self.client.xreadgroup(
                WORKER_GROUP, self.worker_id, {inbox: self._read_id}, count=1024, block=block
            )
            raw_asks = []
        self._read_id = ">"
        for entry_id, fields in reply[0][1] if reply else []:
            self._take(entry_id, from_entry(GenerateRequest, fields))
            self.last_inbox_id = entry_id
        if raw_asks:
            self._preempt([decode(PreemptAsk, raw) for raw in raw_asks])

    def _preempt(self, asks: list[PreemptAsk]) -> None:
        """Pause what the asks need (``worker.engine.preempt``), between two steps; the victims go
        back to the queue through the publisher, after their tokens."""
        for ask in asks:
            victims = plan(self.engine, ask, self.settings.max_preemptions)
            self.publisher.put(self.engine.preempt(victims))
            if victims:
                log.info("paused %s for %s (priority %d)", [r.id for r in victims], ask.request_ids, ask.priority)
        self.num_asks_read += len(asks)  # after the pauses: a record showing the count shows them
        self.heartbeat.poke()  # the asking router waits for the answer and admits against the record

    def _take(self, entry_id: str, msg: GenerateRequest) -> None:
        error = self._refusal(msg)
        if error is not None:
            self.publisher.put(
                [Ended(msg.id, RequestStatus.FAILED, "error", msg.num_emitted, error), Released(msg.id, entry_id)]
            )
            return
        self.engine.add(Req(msg=msg, inbox_id=entry_id))

    def _refusal(self, msg: GenerateRequest) -> str | None:
        """Why this worker cannot run ``msg`` (None: it can). A constraint is not compiled here: it
        compiles off the loop while the request waits (``_end_failed_grammars`` ends it if it fails)."""
        if msg.max_tokens_needed > self.engine.limits.max_total_tokens:
            return (
                f"request needs {msg.max_tokens_needed} tokens; this worker's pool holds "
                f"{self.engine.limits.max_total_tokens}"
            )
        if msg.params.prompt_logprobs is not None and self.settings.tp > 1:
            return "prompt log-probabilities need a worker with --tp 1"
        if msg.params.constraint is not None and self.grammars is None:
            return "this worker cannot apply grammars"
        return None

    def _free_stopped(self) -> None:
        """Requests the publisher ended on a stop string: free their slots now."""
        stopped = set(self.publisher.take_stopped())
        if stopped:
            for req in self.engine.requests():
                if (req.id, req.choice) in stopped:
                    self.publisher.put(self.engine.stop(req))
            self.heartbeat.poke()

    def _refresh_history(self) -> None:
        """The output lengths past-future admission estimates from, re-read now and then."""
        now = time.monotonic()
        if now < self._next_history_read:
            return
        rule = self.engine.rule
        self._next_history_read = now + rule.settings.history_refresh_s
        rule.learn(self.client.lrange(self.keys.output_lengths(), 0, rule.history.window - 1))

    def _check_cancels(self) -> None:
        now = time.monotonic()
        if now < self._next_cancel_check or not self.engine.has_work:
            return
        self._next_cancel_check = now + CANCEL_CHECK_S
        reqs = self.engine.requests()
        # One MGET, not an EXISTS per request: with 1,000 requests every 50 ms, the EXISTS
        # commands alone were a tenth of the model loop's time in a burst.
        marks = self.client.mget([self.keys.cancel(req.id) for req in reqs])
        for req, mark in zip(reqs, marks):
            if mark is not None:
                self.publisher.put(self.engine.cancel(req))
