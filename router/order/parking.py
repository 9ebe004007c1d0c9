"""Entries a router has read and ordered but does not hold: one tenant's flood past its share.

Why: fair shares (``router.order.ordering``) order only what a router has read, and the ingress is read
first come, first read. A router that held at most ``--order_window`` entries of a class stopped
reading it there, so another tenant's request behind a longer flood of one tenant waited until the
flood drained: 95.8 s behind 2,000 requests of one API key on the counting model (a red team,
2026-12-07), where fair shares promise it the next free slot.

Now a router reads on past its window. Every entry is tagged as before (its place in the fair
order is assigned in Redis when it is first read), and one whose tenant already has ``per_tenant``
entries of its class in the router's queue is parked: the router keeps what the order needs
(``Parked``: a few strings and the tag), not the request and its prompt. When the tenant's count in
the queue falls below ``per_tenant``, its parked entries come back oldest tag first (a tenant's tags
only grow as it is read), read again from the stream by id: they stay in this router's pending
list, so no other router takes them, and a restarted router reads them from there again.

Bounds: at most ``limit`` parked entries a router; past it the router stops reading, as at the
window before. A parked entry is ~200 bytes; the default limit (64 windows) is a few MB. Limits:
four tenants flooding one class at once fill the window with their shares, and a fifth's request
behind them waits as before; a parked entry is checked for a cancel or its deadline when it comes
back, not while parked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

from router.order.ordering import forget_parts
from shared import ingress
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import REDIS_FAILURES
from shared.schemas import GenerateRequest

# A tenant holds at most a quarter of the window in the queue: up to three tenants flooding a class
# at once still leave room to read the others' requests (four fill it); and a single tenant's
# backlog still comes back a quarter of a window a step (a burst of one tenant: a batch job's).
TENANT_SHARE = 4
WINDOWS = 64  # parked entries a router keeps, in windows


@dataclass(frozen=True)
class Parked:
    handle: str  # ``shared.ingress.handle``: the stream and entry it is read again from
    tag: float
    request_id: str
    priority: int
    model: str | None
    tenant: str  # as charged (``other`` where its class had no record for its own)

    @classmethod
    def of(cls, handle: str, tag: float, request: GenerateRequest) -> Parked:
        return cls(handle, tag, request.id, request.priority, request.model, request.tenant)


class Parking:
    def __init__(self, order_window: int):
        self.per_tenant = max(1, order_window // TENANT_SHARE)
        self.limit = WINDOWS * order_window
        self._by_tenant: dict[tuple[int, str], deque[Parked]] = {}
        self.count = 0

    def full(self) -> bool:
        return self.count >= self.limit

    def should_park(self, request: GenerateRequest, in_queue: int) -> bool:
        """Whether an entry just read is parked: its tenant has its share of the queue, or has
        entries parked already (they come back first: its order within the tenant holds)."""
        key = (request.priority, request.tenant)
        return not self.full() and (in_queue >= self.per_tenant or key in self._by_tenant)

    def park(self, parked: Parked) -> None:
        self._by_tenant.setdefault((parked.priority, parked.tenant), deque()).append(parked)
        self.count += 1

    def due(self, in_queue: Callable[[int, str], int]) -> list[Parked]:
        """The parked entries whose tenant has room in the queue again (``in_queue(priority,
        tenant)``: its entries there), oldest first; they leave the parking."""
        out: list[Parked] = []
        for key, parked in list(self._by_tenant.items()):
            room = self.per_tenant - in_queue(*key)
            while room > 0 and parked:
                out.append(parked.popleft())
                room -= 1
            if not parked:
                del self._by_tenant[key]
        self.count -= len(out)
        return out

    def restore(self, parked: list[Parked]) -> None:
        """Entries ``due`` handed out and that could not be read back (an outage): first again."""
        for entry in reversed(parked):
            self._by_tenant.setdefault((entry.priority, entry.tenant), deque()).appendleft(entry)
        self.count += len(parked)

    def read_back(self, client: redis.Redis, keys: Keys, in_queue: Callable[[int, str], int]) -> list:
        """``due``'s entries with their stream fields, read in one round trip: (parked, fields), fields
        None for an entry the stream no longer holds (Redis lost it). An outage parks them again."""
        due = self.due(in_queue)
        if not due:
            return []
        pipe = client.pipeline(transaction=False)
        for parked in due:
            stream, raw_id = ingress.locate(keys, parked.handle)
            pipe.xrange(stream, raw_id, raw_id)
        try:
            replies = pipe.execute()
        except REDIS_FAILURES:  # they are in this router's pending list alone: first again
            self.restore(due)
            raise
        return [(parked, found[0][1] if found else None) for parked, found in zip(due, replies)]


def forget_parked(client: redis.Redis, keys: Keys, parked: Parked) -> None:
    """A parked entry that will never be dispatched (gone, unreadable): acknowledged, out of the order."""
    pipe = client.pipeline(transaction=True)
    stream, raw_id = ingress.locate(keys, parked.handle)
    pipe.xack(stream, ROUTER_GROUP, raw_id)
    forget_parts(pipe, keys, parked.request_id, parked.priority, parked.model, parked.tenant)
    pipe.execute()
