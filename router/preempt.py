"""Preempt and resume (``--preempt``): make room for a request that fits no worker.

When the head of the queue (the best class this router holds) fits no
worker, waiting for running requests of worse classes to finish is what
made a better class's time to first token several times its unloaded value
at overload (bench/RESULTS.md). So the router asks one worker to pause
enough of them (``shared.schemas.PreemptAsk`` on its ``{w:ID}:preempt``
list): the one whose record lists the worst class (``WorkerLoad.preemptible``;
ties: more tokens in classes worse than the request's, then the lesser id).
An ask makes room for the head and up to ``ASK_MOST - 1`` requests of its
class right behind it (``heads``): a burst should not wait one round trip
per request. The worker decides which requests and how many (``worker.engine.preempt``),
hands them back to the queue with their emitted tokens, and publishes its
record at once; the request is then admitted against it as usual.

One ask at a time per router: the next waits until the asked worker has
published a record after answering it (its ``preempt_asks_read`` past the
count when asked; the worker reads and deletes its whole list at once, so
with several routers another's ask read just before ours was pushed can
end the wait early, at worst one superfluous ask) or ``WAIT_S`` passed
(the ask expired unread). Without that, a router polling every few
milliseconds would ask again and again before the first answer shows, and
pause far more than needed.
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
REASK_S = 0.25
ASK_MOST = 8  # requests one ask makes room for


def victim_worker(request: GenerateRequest, loads: Mapping[str, WorkerLoad]) -> str | None:
    """The worker to ask for ``request``'s room: serving its model, not draining, running a class
    strictly worse than its priority; the worst class wins, then the most tokens worse than it."""
    best: tuple[int, int, str] | None = None
    for worker_id, load in loads.items():
        if load.draining or not load.serves(request.model):
            continue
        worse = [(priority, held) for priority, held in load.preemptible if priority > request.priority]
        if not worse:
            continue
        key = (-max(p for p, _ in worse), -sum(h for _, h in worse), worker_id)
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
class _Asked:
    worker_id: str
    request_id: str
    answered: int  # the record's preempt_asks_read when asked
    at: float


class Preempter:
    def __init__(self, client: redis.Redis, keys: Keys, clock: Callable[[], float] = time.monotonic):
        self.client, self.keys, self.clock = client, keys, clock
        self._asked: _Asked | None = None
        self.num_asks = 0

    def ask(self, waiting: Sequence[GenerateRequest], loads: Mapping[str, WorkerLoad]) -> str | None:
        """Ask a worker to make room for ``waiting`` (the head of the queue, which fits no worker,
        and those right behind it: ``heads``); the worker asked, or None (an earlier ask is still
        being answered, or no worker runs a worse class)."""
        request = waiting[0]
        if self._holds(request, loads):
            return None
        worker_id = victim_worker(request, loads)
        if worker_id is None:
            return None
        states = [[tuple(s) for s in request_states(r)] for r in waiting]
        ask = PreemptAsk(
            request_ids=[r.id for r in waiting],
            priority=request.priority,
            states=[s for each in states for s in each],
            sizes=[len(each) for each in states],
            asked_ms=now_ms(),
        )
        pipe = self.client.pipeline(transaction=True)
        pipe.rpush(self.keys.preempt(worker_id), encode(ask))
        pipe.pexpire(self.keys.preempt(worker_id), ASK_TTL_MS)
        pipe.execute()
        self._asked = _Asked(worker_id, request.id, loads[worker_id].preempt_asks_read, self.clock())
        self.num_asks += 1
        return worker_id

    def _holds(self, request: GenerateRequest, loads: Mapping[str, WorkerLoad]) -> bool:
        """Whether the last ask holds this one back: not answered yet (for at most ``WAIT_S``), or
        answered for this same request less than ``REASK_S`` ago (its worker could not make room,
        or the room went to a request it had taken in before: ask again, not at once)."""
        asked, now = self._asked, self.clock()
        if asked is None:
            return False
        load = loads.get(asked.worker_id)
        if load is None or now - asked.at > WAIT_S:
            self._asked = None
            return False
        if load.preempt_asks_read <= asked.answered:
            return True
        return asked.request_id == request.id and now - asked.at < REASK_S
