"""The worker's reads of Redis, off the model loop: its inbox, the routers' asks, cancels, history.

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
from shared.lora import LoraRegistry
from shared.redis import OUTAGES, Backoff, ensure_group
from shared.schemas import GenerateRequest
from shared.worker_load import PreemptAsk

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
