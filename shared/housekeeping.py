"""Housekeeping of lightq's Redis records; rq runs it periodically (``producer.batches.rq_worker``).

Three sweeps, each safe to run at any time, from any number of places:

- ``trim_ingress``: the ingress stream keeps every entry until trimmed;
  ``XTRIM MINID`` removes those below the first one a consumer group still
  needs (its oldest pending entry, or the first it has not been given).
- ``sweep_request_records``: a request's chunk stream gets its TTL when the
  request ends; one whose request never ended (its status hash expired, or
  its writer died before the end) would stay for ever. Such leftovers are
  deleted once quiet for a TTL; one whose request did end gets its TTL.
  A persisted SCAN cursor bounds the work of one run.
- ``drop_stale_workers``: a worker that vanished without a router to reap
  it stays in the workers set; one unseen for ``stale_s``, whose load
  record is gone and whose inbox is empty, is removed with its inbox.
"""

from __future__ import annotations

import re

import redis

from shared import ingress
from shared.keys import Keys
from shared.redis import primaries
from shared.request_log import now_ms
from shared.schemas import RequestMeta
from shared.worker_load import stream_id

# Atomic: a worker that came back (load record) or still holds requests (inbox) stays.
DROP_WORKER = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
local seen = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not seen or tonumber(seen) > tonumber(ARGV[2]) then return 0 end
if redis.call('EXISTS', KEYS[3]) == 1 and redis.call('XLEN', KEYS[3]) > 0 then return 0 end
redis.call('DEL', KEYS[3])
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


def trim_ingress(client: redis.Redis, keys: Keys) -> int:
    """Delete ingress entries every consumer group is done with, in every class's stream
    (``shared.ingress``); returns how many went."""
    return sum(_trim(client, stream) for _, stream in ingress.streams(client, keys))


def _trim(client: redis.Redis, stream: str) -> int:
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        return 0
    if not groups:
        return 0  # nobody has read anything: everything is still needed
    floors = []
    for group in groups:
        # XPENDING after XINFO: the entries pending then may all be acknowledged by now (min None:
        # it raised and the whole housekeeping run was lost, a red team's soak); then, as none pending.
        oldest = client.xpending(stream, group["name"])["min"] if group["pending"] else None
        if oldest is not None:
            floors.append(stream_id(oldest))
        else:
            ms, seq = stream_id(group["last-delivered-id"])
            floors.append((ms, seq + 1))
    ms, seq = min(floors)
    return int(client.xtrim(stream, minid=f"{ms}-{seq}", approximate=False))


def sweep_request_records(client: redis.Redis, keys: Keys, ttl_s: int, count: int) -> dict[str, int]:
    """One step of the sweep over request records without a TTL (on a cluster, a step on each
    primary); how many requests' leftovers were deleted, and how many ended requests got their TTL."""
    deleted = expired = 0
    for node, server in enumerate(primaries(client)):
        cursor = int(client.get(keys.housekeeping_cursor(node)) or 0)
        cursor, found = server.scan(cursor=cursor, match=f"{_glob_escape(keys.prefix)}:*", count=count)
        ids = {_request_id(keys, key) for key in found if server.ttl(key) == -1}
        for request_id in sorted(request_id for request_id in ids if request_id is not None):
            raw = client.hgetall(keys.meta(request_id))
            if not raw:
                deleted += _delete_if_quiet(client, keys, request_id, ttl_s)
            elif "status" not in raw or RequestMeta.from_hash(raw).status.is_terminal:
                # A hash without its status (a write after the record expired, an emptied Redis) is
                # an unknown request to every reader (a 404): its keys go like an ended request's.
                # (EXPIRE NX would do, but it needs Redis 7; the embedded one is 6.2)
                lacking = [key for key in keys.all_request_keys(request_id) if client.ttl(key) == -1]
                expired += any([client.expire(key, ttl_s) for key in lacking])
        client.set(keys.housekeeping_cursor(node), cursor)
    return {"deleted": deleted, "expired": expired}


def _delete_if_quiet(client: redis.Redis, keys: Keys, request_id: str, ttl_s: int) -> int:
    """Delete a request's leftovers (no status hash) unless its chunk stream moved within ``ttl_s``."""
    last = client.xrevrange(keys.chunks(request_id), count=1) if client.exists(keys.chunks(request_id)) else []
    if last and now_ms() - stream_id(last[0][0])[0] < ttl_s * 1000:
        return 0
    gone = [client.delete(key) for key in (keys.chunks(request_id), keys.cancel(request_id))]  # two slots
    return int(any(gone))


def _request_id(keys: Keys, key: str) -> str | None:
    """The request a key belongs to (``shared.keys``: ``P:{q}:r:ID:meta|cancel``, ``P:{rN-K}:ID:chunks``)."""
    rest = key[len(keys.prefix) + 1 :]
    match = re.fullmatch(r"\{q\}:r:(?P<id>.+):(?:meta|cancel)|\{r\d+-\d+\}:(?P<data>.+):chunks", rest)
    if match is None:
        return None
    return match.group("id") or match.group("data")


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def drop_stale_workers(client: redis.Redis, keys: Keys, stale_s: float) -> list[str]:
    """Remove workers unseen for ``stale_s`` with no load record and an empty inbox; returns their ids."""
    cutoff = now_ms() - int(stale_s * 1000)
    drop = client.register_script(DROP_WORKER)
    dropped = []
    for worker_id in client.zrangebyscore(keys.workers(), "-inf", cutoff):
        if drop(keys=[keys.workers(), keys.load(worker_id), keys.inbox(worker_id)], args=[worker_id, cutoff]):
            dropped.append(worker_id)
    return dropped


def run_all(
    client: redis.Redis, keys: Keys, *, ttl_s: int, stale_worker_s: float, scan_count: int
) -> dict[str, object]:
    """Every sweep once; what each did."""
    return {
        "ingress_trimmed": trim_ingress(client, keys),
        "request_records": sweep_request_records(client, keys, ttl_s, scan_count),
        "workers_dropped": drop_stale_workers(client, keys, stale_worker_s),
    }
