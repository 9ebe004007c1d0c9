"""The ingress streams into a router's queue: reading, tagging, parking.

One stream per priority class (``shared.ingress``), read through the ``routers`` consumer group
in one XREADGROUP over every class the queue holds fewer than ``order_window`` of. Each entry
gets its fair-share tag from Redis (``router.order.ordering.Tagger``, one round trip a read) and its
place in the ``OrderedQueue``, or is parked past its tenant's share (``router.order.parking``). Entries
stay pending in this router's list until the router dispatches or ends them: after a restart
they are read again, page by page, from id 0. An entry that does not parse is dead-lettered.
"""

from __future__ import annotations

import logging

import redis

from router.order.ordering import OrderedQueue, Tagger, parse_weights
from router.order.parking import Parked, Parking, forget_parked
from shared import ingress
from shared.codec import entry, from_entry
from shared.config import RouterSettings
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import DeadLetter, GenerateRequest

log = logging.getLogger("lightq.router")


class Intake:
    def __init__(self, settings: RouterSettings, client: redis.Redis, router_id: str, queue: OrderedQueue):
        self.settings, self.client, self.keys = settings, client, settings.redis.keys
        self.router_id = router_id
        self.queue = queue
        self.parking = Parking(settings.order_window)  # one tenant's flood past its share (router.order.parking)
        self.tagger = Tagger(client, self.keys, parse_weights(settings.tenant_weights), settings.max_tenants)
        # Per class stream (shared.ingress): "0" first, our own pending entries (after a restart)
        # page by page, then ">" for new ones. A stream is listed here once its group exists.
        self.read_ids: dict[str, str] = {}
        self.queued_ids: set[str] = set()  # handles in the queue or parked: each entry once

    def ensure_groups(self) -> None:
        """Recreate the consumer group of every stream read so far if Redis lost it (a restart
        without persistence)."""
        for stream in self.read_ids:
            ensure_group(self.client, stream, ROUTER_GROUP)

    def read(self) -> None:
        """New entries of every class this router holds fewer than ``order_window`` of, in one
        XREADGROUP over their streams (``shared.ingress``: a flood of one class never hides a
        better one). Up to ``read_batch`` a stream per read, so a class may pass the window by
        less than that."""
        by_stream: dict[str, int] = {}
        for priority, stream in ingress.streams(self.client, self.keys):
            if stream not in self.read_ids:  # a class new to this router: its group from entry 0
                ensure_group(self.client, stream, ROUTER_GROUP)
                self.read_ids[stream] = "0"
            if self.queue.count(priority) < self.settings.order_window and not self.parking.full():
                by_stream[stream] = priority
        if not by_stream:
            return
        count = self.settings.read_batch
        restarting = {s: self.read_ids[s] for s in by_stream if self.read_ids[s] != ">"}
        if restarting:  # after a restart: entries we read but never dispatched, page by page
            got = self._xreadgroup(restarting, by_stream, count, None)
            for stream in restarting:
                entries = got.get(stream, [])
                self.read_ids[stream] = entries[-1][0] if len(entries) == count else ">"
            if any(got.values()):
                return
        block = None if self.queue else self.settings.poll_ms
        self._xreadgroup(dict.fromkeys(by_stream, ">"), by_stream, count, block)

    def _xreadgroup(
        self, ids: dict[str, str], priorities: dict[str, int], count: int, block: int | None
    ) -> dict[str, list]:
        try:
            reply = self.client.xreadgroup(ROUTER_GROUP, self.router_id, ids, count=count, block=block)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # Redis lost the group under us (restarted empty, flushed, the stream evicted), long before
            # housekeeping would notice: made again now, and our own pending entries read from the
            # start of the new one. (It raised out of the loop before: the router exited, and serve
            # took three such exits for a failed start and stopped the pool.)
            log.warning("router %s: Redis lost the consumer group of %s; made again", self.router_id, list(ids))
            for stream in ids:
                ensure_group(self.client, stream, ROUTER_GROUP)
                self.read_ids[stream] = "0"
            return {}
        got = {stream: entries for stream, entries in reply or []}
        for stream, entries in got.items():
            self.take(priorities[stream], entries)
        return got

    def take(self, priority: int, entries: list) -> None:
        """Entries of class ``priority``'s stream into the queue, each at its place in the order
        (tags from Redis, one round trip); the queue names them by ``ingress.handle``."""
        taken: list[tuple[str, GenerateRequest]] = []
        for entry_id, fields in entries:
            # An entry can reach us twice: claimed from a dead router, then re-read from our own
            # pending list. The queue holds each entry once.
            name = ingress.handle(priority, entry_id)
            if name in self.queued_ids:
                continue
            request = self._parse(priority, entry_id, fields)
            if request is not None:
                taken.append((name, request))
                self.queued_ids.add(name)
        for (name, _), (tag, request) in zip(taken, self.tagger.tags([r for _, r in taken])):
            # the request as charged: maybe to ``other``; past its tenant's share, parked
            if self.parking.should_park(request, self.queue.tenant_count(request.priority, request.tenant)):
                self.parking.park(Parked.of(name, tag, request))
            else:
                self.queue.add(name, request, tag)

    def unpark(self) -> None:
        """Parked entries whose tenant has room in the queue again, read back (one round trip) into
        their places in the order (``router.order.parking``)."""
        for parked, fields in self.parking.read_back(self.client, self.keys, self.queue.tenant_count):
            request = None if fields is None else self._parse(parked.priority, ingress.entry_id(parked.handle), fields)
            if request is None:  # gone (Redis lost it) or unreadable (dead-lettered): out of the order
                self.queued_ids.discard(parked.handle)
                forget_parked(self.client, self.keys, parked)
                continue
            if request.tenant != parked.tenant:  # charged as when read
                request = request.model_copy(update={"tenant": parked.tenant})
            self.queue.add(parked.handle, request, parked.tag)

    def _parse(self, priority: int, entry_id: str, fields: dict) -> GenerateRequest | None:
        try:
            return from_entry(GenerateRequest, fields)
        except ValueError as exc:  # unreadable: never retry it, keep it for inspection
            log.error("dead-lettering unreadable entry %s: %s", entry_id, exc)
            pipe = self.client.pipeline(transaction=True)
            letter = DeadLetter(reason=f"unreadable: {exc}"[:500], failed_ms=now_ms(), raw=fields)
            pipe.xadd(self.keys.dead_letters(), entry(letter))
            pipe.xack(self.keys.requests(priority), ROUTER_GROUP, entry_id)
            pipe.execute()
            return None
