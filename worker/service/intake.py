"""The worker's reads of Redis, off the model loop (its inbox, the routers' asks, cancels, history),
and what the loop does with what they found.

The model loop used to read its inbox (and the routers' preemption asks) on
every step, and the cancel keys of what it held every 50 ms: a round trip it
waited for between two steps. On the 2-core sandbox under a burst of 512
requests that wait was about a third of the loop's time (py-spy: the loop in
``read_from_socket``), while Redis served everyone else. A thread of its own
now does these reads: it blocks on the inbox (an arrival wakes it at once),
takes the asks after each read, looks up the cancel keys of the requests the
worker holds every ``CANCEL_CHECK_S``, re-reads the output-length history now
and then and the run-time LoRA registry every ``LORA_CHECK_S``, and hands
what it found to the model loop through a queue, which the loop drains
between steps without waiting (or waits on, when idle). A Redis outage
stalls the thread, never a step.

Without its thread (``start`` not called: tests that turn the loop by hand)
``take`` reads inline, once a call, as the loop did.

The loop's half (``ArrivalsMixin``, part of ``worker.service.serve.WorkerService``)
takes what was read, between two steps: the run-time LoRA registry first (a
request may name an adapter just loaded); each inbox entry into the engine,
unless it is refused here (it ends ``failed``, saying why), an older copy of it
still runs here (that copy stops, the request is queued again) or the worker
drains (it goes back); the routers' asks and the pauses they (and, with
``--preempt``, the arrivals) need; cancels; the output-length history.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from shared.codec import decode, from_entry
from shared.config import CANCEL_CHECK_S
from shared.keys import WORKER_GROUP, Keys
from shared.log_limit import LogLimiter
from shared.lora import LoraRegistry, gone_error
from shared.redis import OUTAGES, Backoff, ensure_group
from shared.requeue import requeue
from shared.schemas import Constraint, GenerateRequest, RequestStatus
from shared.worker_load import PreemptAsk, too_large_error
from worker.engine.events import Ended, Released
from worker.engine.preempt import plan, unasked_plan
from worker.engine.request import Req

log = logging.getLogger("lightq.worker")

BLOCK_MS = 50  # the thread's longest wait on an empty inbox: asks and cancels are read at least this often
MAX_ASKS = 1000  # preemption asks taken in one read (routers ask a worker a few at a time)
MAX_ENTRIES = 1024
# How often the run-time LoRA registry is read: one GET, so a load reaches every worker within this
# (plus a step) without a channel to lose messages on.
LORA_CHECK_S = 0.25


@dataclass
class Arrivals:
    """What one read found: inbox entries (entry id, request, its dispatch's epoch), asks, the ids of
    held requests whose cancel key is set, and the output-length history when it was re-read."""

    entries: list[tuple[str, GenerateRequest, int]] = field(default_factory=list)
    asks: list[PreemptAsk] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    history: list[str] | None = None
    lora: LoraRegistry | None = None  # the run-time adapters, when the registry changed (shared.lora)

    def __bool__(self) -> bool:
        return bool(self.entries or self.asks or self.cancelled or self.history is not None or self.lora is not None)


class Intake:
    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        worker_id: str,
        held: Callable[[], list[str]],
        history: Callable[[], tuple[int, float]],
        lora_key: str | None = None,
    ):
        self.client, self.keys, self.worker_id = client, keys, worker_id
        self.inbox, self.asks = keys.inbox(worker_id), keys.preempt(worker_id)
        self.held = held  # the ids of the requests the engine holds (thread-safe)
        self.history = history  # the output-length window, and how often it is read
        self.read_id = "0"  # our own pending entries first (after a restart), then new ones
        self.next_cancels = self.next_history = self.next_lora = 0.0
        self.lora_key = lora_key  # the model's run-time adapter registry (None: not read)
        self.lora_seen: bytes | str | None = None  # its value last handed over (None: no key)
        self.arrivals: queue.Queue[Arrivals] = queue.Queue()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="intake", daemon=True)
        self.thread.start()

    def stop(self) -> list[Arrivals]:
        """Stop reading (within one blocked read); what was read and not taken yet."""
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()
        return self.take(wait_s=0.0)

    def take(self, wait_s: float | None) -> list[Arrivals]:
        """Everything read since the last call; with ``wait_s`` > 0, wait that long for something."""
        if self.thread is None:  # inline: one read now (blocking when the caller is idle)
            found = self.read(block_ms=int(wait_s * 1000) if wait_s else None)
            return [found] if found else []
        taken: list[Arrivals] = []
        try:
            if wait_s:
                taken.append(self.arrivals.get(timeout=wait_s))
            while True:
                taken.append(self.arrivals.get_nowait())
        except queue.Empty:
            return taken

    def read(self, block_ms: int | None) -> Arrivals:
        """One pass: new inbox entries (waiting up to ``block_ms`` for one), the asks, and the
        cancels and the history when due. Raises Redis errors (an outage) to its caller."""
        found = Arrivals()
        if self.read_id == "0":  # first pass, or after a Redis restart lost the group
            ensure_group(self.client, self.inbox, WORKER_GROUP)
        try:
            reply = self.client.xreadgroup(
                WORKER_GROUP, self.worker_id, {self.inbox: self.read_id}, count=MAX_ENTRIES, block=block_ms
            )
        except redis.ResponseError as exc:
            # NOGROUP: Redis lost our inbox group (restarted empty). UNBLOCKED: the inbox was deleted
            # under our blocked read (a router reaped this worker while it was cut off). Either way the
            # group is made again next pass: the read goes on, and the heartbeat tells the pool we live.
            if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
                raise
            self.read_id = "0"
            return found
        self.read_id = ">"
        for entry_id, fields in reply[0][1] if reply else []:
            # The dispatch's epoch (shared.request_log): absent in an entry a router before it wrote.
            found.entries.append((entry_id, from_entry(GenerateRequest, fields), int(fields.get("epoch", 0))))
        found.asks = [decode(PreemptAsk, raw) for raw in self.client.lpop(self.asks, MAX_ASKS) or []]
        now = time.monotonic()
        if now >= self.next_cancels:
            self.next_cancels = now + CANCEL_CHECK_S
            found.cancelled = self._cancelled()
        if now >= self.next_history:
            window, every_s = self.history()
            self.next_history = now + every_s
            found.history = self.client.lrange(self.keys.output_lengths(), 0, window - 1)
        if self.lora_key is not None and now >= self.next_lora:
            self.next_lora = now + LORA_CHECK_S
            found.lora = self._lora()
        return found

    def _lora(self) -> LoraRegistry | None:
        """The registry, when it differs from what was handed over last (a vanished key: empty)."""
        assert self.lora_key is not None
        raw = self.client.get(self.lora_key)
        if raw == self.lora_seen:
            return None
        self.lora_seen = raw
        return LoraRegistry() if raw is None else decode(LoraRegistry, raw)

    def _cancelled(self) -> list[str]:
        ids = self.held()
        if not ids:
            return []
        # One MGET, not an EXISTS per request: with 1,000 requests every 50 ms, the EXISTS
        # commands alone were a tenth of the model loop's time in a burst.
        marks = self.client.mget([self.keys.cancel(request_id) for request_id in ids])
        return [request_id for request_id, mark in zip(ids, marks) if mark is not None]

    def _run(self) -> None:
        backoff, outage = Backoff(), LogLimiter(log)
        while not self.stop_event.is_set():
            try:
                found = self.read(BLOCK_MS)
            except OUTAGES as exc:
                outage.warning("Redis unreachable (%s): intake waits", exc)  # running requests step on
                self.stop_event.wait(backoff.next())
                continue
            except Exception:  # never a silent death: a worker whose intake died still beats, and gets requests
                log.exception("intake: reading the inbox failed; trying again")
                self.stop_event.wait(backoff.next())
                continue
            backoff.reset()
            outage.reset()
            if found:
                self.arrivals.put(found)


class ArrivalsMixin:
    """``worker.service.serve.WorkerService``'s handling of what its ``Intake`` found, between two
    steps. It works on the service's state (``engine``, ``publisher``, ``heartbeat``, ``lora``,
    ``grammars``, ``settings``, ``client``, ``keys``, ``worker_id``, ``draining``, ``_unstarted``,
    ``last_inbox_id``, ``num_asks_read``), which ``WorkerService.__init__`` makes."""

    def _reconcile_adapters(self) -> None:
        """Load and unload run-time adapters (``worker.lora.runtime``); the routers hear of it now."""
        if self.lora.reconcile({req.msg.adapter for req in self.engine.requests() if req.msg.adapter}):
            self.heartbeat.poke()

    def _arrived(self, found: Arrivals) -> None:
        if found.lora is not None:  # before the entries: a request may name an adapter just loaded
            self.lora.update(found.lora)
            self._reconcile_adapters()
        arrived: list[Req] = []
        for entry_id, msg, epoch in found.entries:
            if self.draining:  # read before the intake stopped: it goes back, never started here
                self._unstarted.append((msg, entry_id))
                continue
            if (req := self._take(entry_id, msg, epoch)) is not None:
                arrived.append(req)
            self.last_inbox_id = entry_id
        if found.asks:
            self._preempt(found.asks)
        if self.settings.preempt:  # after the asks: what they made room for fits now, and asks nothing
            self._pause(unasked_plan(self.engine, arrived, self.settings.max_preemptions), "unasked")
        if found.cancelled:
            cancelled = set(found.cancelled)
            for req in self.engine.requests():  # a group's every sample
                if req.id in cancelled:
                    self.publisher.put(self.engine.cancel(req))
        if found.history is not None:
            self.engine.rule.learn(found.history)

    def _preempt(self, asks: list[PreemptAsk]) -> None:
        """Pause what the asks need (``worker.engine.preempt``), between two steps; the victims go
        back to the queue through the publisher, after their tokens."""
        for ask in asks:
            self._pause(
                plan(self.engine, ask, self.settings.max_preemptions), f"{ask.request_ids} (priority {ask.priority})"
            )
        self.num_asks_read += len(asks)  # after the pauses: a record showing the count shows them
        self.heartbeat.poke()  # the asking router waits for the answer and admits against the record

    def _pause(self, victims: list[Req], why: str) -> None:
        if not victims:  # the usual answer, every pass with --preempt: nothing to take or publish
            return
        self.publisher.put(self.engine.preempt(victims))
        log.info("paused %s for %s", [r.id for r in victims], why)
        self.heartbeat.poke()

    def _take(self, entry_id: str, msg: GenerateRequest, epoch: int) -> Req | None:
        """The request added to the engine, or None (refused here, or a stale copy's twin)."""
        stale = [req for req in self.engine.requests() if req.id == msg.id]
        if stale:  # an older copy runs here: the pool took it back while this worker was cut off
            self._requeue_stale(entry_id, msg, stale)
            return None
        error = self._refusal(msg)
        if error is not None:
            ended = Ended(msg.id, RequestStatus.FAILED, "error", msg.num_emitted, error, epoch=epoch)
            self.publisher.put([ended, Released(msg.id, entry_id)])
            return None
        req = Req(msg=msg, inbox_id=entry_id, epoch=epoch)
        self.engine.add(req)
        return req

    def _requeue_stale(self, entry_id: str, msg: GenerateRequest, stale: list) -> None:
        """A request dispatched here again while its older copy still runs here (the pool gave up on
        this worker, cut off or frozen, and it came back): the old copy stops (its writes are refused:
        its epoch moved on) and the new entry goes back to the queue, to start anywhere once the old
        copy is gone; two copies of one id are never in the engine together."""
        for req in stale:
            self.publisher.put(self.engine.stop(req))
        log.warning("%s came back while its older copy ran here: the copy stops, the request is queued again", msg.id)
        requeue(self.client, self.keys, msg, self.settings.redis.request_ttl_s, self.settings.max_attempts)
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, entry_id)
        pipe.xdel(self.keys.inbox(self.worker_id), entry_id)
        pipe.execute()

    def _refusal(self, msg: GenerateRequest) -> str | None:
        """Why this worker cannot run ``msg`` (None: it can). A constraint is not compiled here: it
        compiles off the loop while the request waits (``_end_failed_grammars`` ends it if it fails)."""
        if msg.max_tokens_needed > self.engine.limits.max_total_tokens:  # the producer's 400, as its own check
            return too_large_error(
                f"this request can need {msg.max_tokens_needed} KV tokens; this worker's pool holds "
                f"{self.engine.limits.max_total_tokens}"
            )
        if msg.params.prompt_logprobs is not None and self.settings.tp > 1:
            return "prompt log-probabilities need a worker with --tp 1"
        if msg.params.constraint is not None and self.grammars is None:
            # no tokenizer that matches the model's vocabulary (the counting stand-in's): the client's 400
            return (
                f"{Constraint.UNSUPPORTED}: this pool's workers apply no grammars (the model has no matching tokenizer)"
            )
        if msg.adapter is not None and msg.adapter not in self.lora.view.serving and not self.lora.adopt(msg):
            # unloaded after the router sent it (it checks the records), or it moved and cannot bring it: a 404
            return gone_error(msg.adapter, started=msg.has_output)
        return None
