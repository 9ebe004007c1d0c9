"""Preempt and resume (``--preempt``): make room for a request that fits no worker.

When the head of the queue (the best class this router holds) fits no
worker, waiting for running requests of worse classes to finish is what
made a better class's time to first token several times its unloaded value
at overload (bench/RESULTS.md). So the router asks one worker to pause
enough of them (``shared.schemas.PreemptAsk`` on its ``{w:ID}:preempt``
list): the one whose record lists the worst class (``WorkerLoad.preemptible``;
ties: more tokens in classes worse than the request's, then the lesser id).
An ask makes room for the head and up to ``ASK_MOST - 1`` requests of its
class right behind it (``heads``), and the router sends them to that
worker's inbox with it (``Router._preempt_for``): the worker reads both in
one round trip, decides which requests to pause and how many
(``worker.engine.preempt``), hands those back to the queue with their
emitted tokens and admits the waiting ones in the same step, instead of
publishing its record and waiting for the router's next dispatch.

Asks are not serialised: a burst of a better class on a full pool needs
one per request (or per ``ASK_MOST``), and waiting for each answer made the
burst queue behind it. Instead the router books the tokens it asked each
worker to free (the requests' held tokens) until the worker's record shows
an answer (its ``preempt_asks_read`` grew), and a worker whose worse-class
tokens are all promised is not asked again until then: the record's
``preemptible`` is stale for a heartbeat, and asking on it would send
requests to a worker with nothing left to pause.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import redis

from shared.admission import request_states
from shared.codec import encode
from shared.keys import Keys
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, PreemptAsk, WorkerLoad

ASK_TTL_MS = 2000  # an ask its worker never read (it went idle, or died) goes with the key
WAIT_S = 1.0
ASK_MOST = 8  # requests one ask makes room for


def victim_worker(
    request: GenerateRequest,
    loads: Mapping[str, WorkerLoad],
    promised: Mapping[str, int] | None = None,
    preemptible: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> str | None:
    """The worker to ask for ``request``'s room: serving its model, not draining, running a class
    strictly worse than its priority with tokens not already ``promised`` to earlier asks; the
    worst class wins, then the most such tokens. ``preemptible``: what each worker may pause
    (``Reservations.preemptible``: its record's, plus requests sent since); default the records'."""
    best: tuple[int, int, str] | None = None
    for worker_id, load in loads.items():
        if load.draining or not load.serves(request.model) or request.max_tokens_needed > load.max_total_tokens:
            continue  # (a request its pool can never hold would be refused there)
        classes = load.preemptible if preemptible is None else preemptible.get(worker_id, load.preemptible)
        worse = [(priority, held) for priority, held in classes if priority > request.priority]
        free = sum(h for _, h in worse) - (promised or {}).get(worker_id, 0)
        if not worse or free <= 0:
            continue
        key = (-max(p for p, _ in worse), -free, worker_id)
        best = key if best is None or key < best else best
    return None if best is None else best[2]


def heads(queue: Sequence[tuple[str, GenerateRequest]], most: int = ASK_MOST) -> list[GenerateRequest]:
    """The head of the queue and the requests right behind it of its class and model, at most
    ``most``: one ask makes room for a burst of them (one at a time, a burst of a better class
    would wait an ask's round trip per request)."""
    head = queue[0][1]
    waiting = [head]
    for i in range(1, min(most, len(queue))):
        request = queue[i][1]
        if request.priority != head.priority or request.model != head.model:
            break
        waiting.append(request)
    return waiting


@dataclass(frozen=True)
class _Booked:
    answered: int  # the worker's preempt_asks_read when first asked since its last answer
    tokens: int  # tokens asked of it since
    at: float


class Preempter:
    def __init__(self, client: redis.Redis, keys: Keys, clock: Callable[[], float] = time.monotonic):
        self.client, self.keys, self.clock = client, keys, clock
        self._booked: dict[str, _Booked] = {}  # worker -> what this router asked of it, unanswered
        self.num_asks = 0
        self._outbox: list[tuple[str, PreemptAsk]] = []  # sent by ``flush``, after the requests' dispatch

    def flush(self) -> None:
        """Send the asks made since the last call. After the dispatch of their requests: the worker
        reads its inbox and its asks in one round trip, and an ask read before its requests are
        in the inbox frees room that something else may take first."""
        if not self._outbox:
            return
        pipe = self.client.pipeline(transaction=True)
        for worker_id, ask in self._outbox:
            pipe.rpush(self.keys.preempt(worker_id), encode(ask))
            pipe.pexpire(self.keys.preempt(worker_id), ASK_TTL_MS)
        pipe.execute()
        self._outbox.clear()

    def ask(
        self,
        waiting: Sequence[GenerateRequest],
        loads: Mapping[str, WorkerLoad],
        preemptible: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    ) -> str | None:
        """Ask a worker to make room for ``waiting`` (the head of the queue, which fits no worker,
        and those right behind it: ``heads``; the ask leaves with ``flush``); the worker asked, or
        None (no worker runs a worse class with tokens not promised yet). ``preemptible``: as
        ``victim_worker`` takes it."""
        self._settle(loads)
        request = waiting[0]
        worker_id = victim_worker(request, loads, {w: b.tokens for w, b in self._booked.items()}, preemptible)
        if worker_id is None:
            return None
        states = [request_states(r) for r in waiting]
        ask = PreemptAsk(
            request_ids=[r.id for r in waiting],
            priority=request.priority,
            states=[tuple(s) for each in states for s in each],
            sizes=[len(each) for each in states],
            asked_ms=now_ms(),
        )
        self._outbox.append((worker_id, ask))
        booked = self._booked.get(worker_id) or _Booked(loads[worker_id].preempt_asks_read, 0, self.clock())
        tokens = sum(s.held for each in states for s in each)
        self._booked[worker_id] = _Booked(booked.answered, booked.tokens + tokens, booked.at)
        self.num_asks += 1
        return worker_id

    def _settle(self, loads: Mapping[str, WorkerLoad]) -> None:
        """A worker whose record shows an answer (or that is gone, or silent for ``WAIT_S``: the
        ask expired unread) leaves the books: its ``preemptible`` is what it has now."""
        now = self.clock()
        self._booked = {
            worker_id: booked
            for worker_id, booked in self._booked.items()
            if worker_id in loads and loads[worker_id].preempt_asks_read <= booked.answered and now - booked.at < WAIT_S
        }
