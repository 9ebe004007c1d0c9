"""Preempt and resume (``--preempt``): make room for a request that fits no worker.

When the head of the queue (the best class this router holds) fits no
worker, waiting for running requests of worse classes to finish is what
made a better class's time to first token several times its unloaded value
at overload (bench/RESULTS.md). So the router asks one worker to pause
enough of them (``shared.worker_load.PreemptAsk`` on its ``{q}:w:ID:preempt``
list): the one whose record lists the worst class (``WorkerLoad.preemptible``;
ties: more tokens in classes worse than the request's, then the lesser id).
An ask makes room for the head and up to ``ASK_MOST - 1`` requests of its
class right behind it (``heads``), no more than the worker has requests to
pause (a pause frees one request slot: without that bound, a burst of
short prompts booked few tokens an ask and was sent, dozens deep, into the
queue of a worker that could free 7 slots, out of the router's fair order;
a paused group frees a slot per sample),
and the router sends them to that worker's inbox with it (``Router._preempt_for``): the worker reads both in
one round trip, decides which requests to pause and how many
(``worker.engine.preempt``), hands those back to the queue with their
emitted tokens and admits the waiting ones in the same step, instead of
publishing its record and waiting for the router's next dispatch.

Asks are not serialised: a burst of a better class on a full pool needs
one per request (or per ``ASK_MOST``), and waiting for each answer made the
burst queue behind it. Instead the router books the tokens and requests it asked each
worker to free (the requests' held tokens, one request each) until the worker's record shows
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
from shared.schemas import GenerateRequest
from shared.worker_load import PreemptAsk, WorkerLoad

ASK_TTL_MS = 2000  # an ask its worker never read (it went idle, or died) goes with the key
WAIT_S = 1.0
ASK_MOST = 8  # requests one ask makes room for


Classes = Sequence[tuple[int, int, int]]  # [priority, tokens, requests] a better class may pause


def victim_worker(
    request: GenerateRequest,
    loads: Mapping[str, WorkerLoad],
    promised: Mapping[str, tuple[int, int]] | None = None,
    preemptible: Mapping[str, Classes] | None = None,
) -> str | None:
    """The worker to ask for ``request``'s room: serving its model, not draining, running a class
    strictly worse than its priority with tokens and requests not already ``promised`` to earlier
    asks; the worst class wins, then the most such tokens. ``preemptible``: what each worker may
    pause (``Reservations.preemptible``: its record's, plus requests sent since); default the records'."""
    best: tuple[int, int, str] | None = None
    for worker_id, load in loads.items():
        if (
            load.draining
            or not load.serves(request.model, request.adapter)
            or request.max_tokens_needed > load.max_total_tokens
        ):
            continue  # (a request its pool can never hold would be refused there)
        classes = load.preemptible if preemptible is None else preemptible.get(worker_id, load.preemptible)
        tokens, requests = room(classes, request.priority, (promised or {}).get(worker_id, (0, 0)))
        if tokens <= 0 or requests <= 0:
            continue
        worst = max(p for p, *_ in classes)
        key = (-worst, -tokens, worker_id)
        best = key if best is None or key < best else best
    return None if best is None else best[2]


def room(classes: Classes, priority: int, promised: tuple[int, int]) -> tuple[int, int]:
    """Tokens and requests of classes worse than ``priority`` not yet promised to earlier asks."""
    worse = [(tokens, count) for p, tokens, count in classes if p > priority]
    return sum(t for t, _ in worse) - promised[0], sum(n for _, n in worse) - promised[1]


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


def within(slots: int, states: list[tuple]) -> list[tuple]:
    """The first requests' states that take at most ``slots`` request slots (a group's samples one
    each), and always the first: the worker's own plan decides whether it can be made to fit."""
    taken, count = 0, 0
    for each in states:
        if count and taken + len(each) > slots:
            break
        taken, count = taken + len(each), count + 1
    return states[:count]


@dataclass(frozen=True)
class _Booked:
    answered: int  # the worker's preempt_asks_read when first asked since its last answer
    tokens: int  # tokens asked of it since
    requests: int  # and requests (each takes the slot of one it pauses)
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
        preemptible: Mapping[str, Classes] | None = None,
    ) -> tuple[str, int] | None:
        """Ask a worker to make room for ``waiting`` (the head of the queue, which fits no worker,
        and those right behind it: ``heads``; the ask leaves with ``flush``): the worker asked and
        how many of ``waiting`` (the first ones) it is asked for, at most as many as it has
        requests to pause; or None (no worker runs a worse class with room not promised yet).
        ``preemptible``: as ``victim_worker`` takes it."""
        self._settle(loads)
        request = waiting[0]
        promised = {w: (b.tokens, b.requests) for w, b in self._booked.items()}
        worker_id = victim_worker(request, loads, promised, preemptible)
        if worker_id is None:
            return None
        classes = loads[worker_id].preemptible if preemptible is None else preemptible[worker_id]
        _, free = room(classes, request.priority, promised.get(worker_id, (0, 0)))
        states = within(free, [request_states(r) for r in waiting])
        waiting = waiting[: len(states)]
        ask = PreemptAsk.for_requests([r.id for r in waiting], request.priority, states, now_ms())
        self._outbox.append((worker_id, ask))
        booked = self._booked.get(worker_id) or _Booked(loads[worker_id].preempt_asks_read, 0, 0, self.clock())
        tokens = sum(s.held for each in states for s in each)
        self._booked[worker_id] = _Booked(
            booked.answered, booked.tokens + tokens, booked.requests + sum(map(len, states)), booked.at
        )
        self.num_asks += 1
        return worker_id, len(waiting)

    def _settle(self, loads: Mapping[str, WorkerLoad]) -> None:
        """A worker whose record shows an answer (or that is gone, or silent for ``WAIT_S``: the
        ask expired unread) leaves the books: its ``preemptible`` is what it has now."""
        now = self.clock()
        self._booked = {
            worker_id: booked
            for worker_id, booked in self._booked.items()
            if worker_id in loads and loads[worker_id].preempt_asks_read <= booked.answered and now - booked.at < WAIT_S
        }
