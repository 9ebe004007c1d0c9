"""Router liveness, and taking over what a dead router held.

Entries a router has read stay in its pending list until dispatched, and
a router may hold them a long time on purpose (no worker has room), so
idle time alone cannot tell a slow router from a dead one. Each router
therefore refreshes a key with a TTL; a consumer of the ``routers`` group
whose key is gone is dead, and a live router claims its pending entries
(XCLAIM) and removes the consumer.
"""

from __future__ import annotations

import logging

import redis

from shared import ingress
from shared.keys import ROUTER_GROUP, Keys

log = logging.getLogger("lightq.router")


def beat(client: redis.Redis, keys: Keys, router_id: str, ttl_s: float) -> None:
    client.set(keys.router_alive(router_id), "1", px=int(ttl_s * 1000))


def forget(client: redis.Redis, keys: Keys, router_id: str) -> None:
    """On a clean exit: our pending entries become claimable at once; with none in a class's stream,
    we leave its group too, so the next router does not report us as gone (only a consumer without
    pending entries may go: deleting one drops its entries from the group's pending list)."""
    client.delete(keys.router_alive(router_id))
    for _, stream in ingress.streams(client, keys):
        try:
            if not client.xpending_range(stream, ROUTER_GROUP, min="-", max="+", count=1, consumername=router_id):
                client.xgroup_delconsumer(stream, ROUTER_GROUP, router_id)
        except redis.ResponseError:  # no such stream or group: nothing of ours in it
            continue


def claim_from_dead_routers(client: redis.Redis, keys: Keys, router_id: str) -> list[tuple[int, list]]:
    """Claim every pending entry of routers whose liveness key expired, in every class's stream;
    returns (priority, entries in id order) per class with any."""
    claimed: list[tuple[int, list]] = []
    for priority, stream in ingress.streams(client, keys):
        try:
            consumers = client.xinfo_consumers(stream, ROUTER_GROUP)
        except redis.ResponseError:  # no group yet on this class's stream: nobody read it
            continue
        entries = []
        for consumer in consumers:
            name = consumer["name"]
            if name == router_id or client.exists(keys.router_alive(name)):
                continue
            pending = client.xpending_range(stream, ROUTER_GROUP, min="-", max="+", count=10_000, consumername=name)
            ids = [p["message_id"] for p in pending]
            if ids:
                entries += client.xclaim(stream, ROUTER_GROUP, router_id, min_idle_time=0, message_ids=ids)
            if len(ids) < 10_000:
                client.xgroup_delconsumer(stream, ROUTER_GROUP, name)
            log.warning("router %s is gone: took over %d of its entries in %s", name, len(ids), stream)
        entries = sorted((e for e in entries if e[1]), key=lambda e: tuple(map(int, e[0].split("-"))))
        if entries:
            claimed.append((priority, entries))
    return claimed
