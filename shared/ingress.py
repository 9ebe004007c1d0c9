"""The ingress: one Redis stream per priority class, so a flood of one class never hides another.

With a single stream, a router that reads ``order_window`` entries ahead
cannot see a better-class request behind more than that many worse-class
entries: it was served strictly first only once the router read that far
(at 2x overload on 16 cores, class 0 waited seconds behind class 1's
backlog). With one stream per class (``Keys.requests(priority)``), a router
reads every class it has room for in one XREADGROUP, so the best class is
always in view, and a window bounds what it holds per class.

Whoever appends to a class's stream also adds the class to
``Keys.classes()`` (in the same transaction or script), so readers find the
streams by one ZRANGE; class 0's stream is always read, listed or not (the
default, and the one deployments without priorities use: the producer's
enqueue skips the ZADD for it). A class's set member is never
removed: an empty stream costs a key.
"""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from shared.codec import entry
from shared.keys import Keys
from shared.schemas import GenerateRequest


def add(pipe: redis.client.Pipeline, keys: Keys, request: GenerateRequest) -> None:
    """Append ``request`` to its class's stream, listing the class (part of the caller's transaction)."""
    pipe.zadd(keys.classes(), {str(request.priority): request.priority})
    pipe.xadd(keys.requests(request.priority), entry(request))


def streams(client: redis.Redis, keys: Keys) -> list[tuple[int, str]]:
    """(priority, stream) of every class with a stream, best (lowest) first; class 0 always."""
    return _by_class(keys, client.zrange(keys.classes(), 0, -1))


async def streams_async(client: aioredis.Redis, keys: Keys) -> list[tuple[int, str]]:
    """``streams`` for an asyncio client (the producer)."""
    return _by_class(keys, await client.zrange(keys.classes(), 0, -1))


def _by_class(keys: Keys, members: list[str]) -> list[tuple[int, str]]:
    return [(p, keys.requests(p)) for p in sorted({int(m) for m in members} | {0})]


def entries(client: redis.Redis, keys: Keys) -> list[tuple[str, dict[str, str]]]:
    """Every entry of every class's stream, oldest first across classes (ids are times): a view for
    tools and tests, not for the hot path."""
    found = [e for _, stream in streams(client, keys) for e in client.xrange(stream)]
    return sorted(found, key=lambda e: tuple(int(x) for x in e[0].split("-")))


def handle(priority: int, entry_id: str) -> str:
    """A router's name for an entry of class ``priority``'s stream: stream ids are unique in one
    stream, not across classes (two streams can both hold 1700000000000-0). Class 0's entries keep
    their plain ids."""
    return entry_id if priority == 0 else f"{entry_id}@{priority}"


def locate(keys: Keys, handle_: str) -> tuple[str, str]:
    """(stream, entry id) a ``handle`` names. The stream is the one the entry was read from, which
    is its request's class's, except for entries queued before streams were per class: those are
    in class 0's stream whatever their class, and are acknowledged there."""
    entry_id, _, priority = handle_.partition("@")
    return keys.requests(int(priority or 0)), entry_id


def entry_id(handle_: str) -> str:
    """The stream id part of a ``handle`` (ordering by arrival within one stream)."""
    return handle_.partition("@")[0]
