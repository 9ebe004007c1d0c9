"""The producer's side of the Redis protocol (see shared/keys.py for the layout).

The producer writes a request's status hash and its ingress entry (with the
backlog check, in one script), sets the cancel key, and reads the status
hash and the durable chunk stream. It never reads the pub/sub channel: the
stream has every chunk, in order, resumable.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import codec
from shared.chunk_schemas import ChunkRun
from shared.chunks import parse_run
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import client_is_cluster, xread_spread
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus

StreamEntry = tuple[str, ChunkRun]  # (stream entry id, its run of chunks; a format-1 entry is a run of one)


# Enqueue, with the backlog check, in one script: producers on many hosts cannot overshoot
# --max_queue_tokens together. The counter KEYS[2] is the total cost ever enqueued; every
# entry records the total before it ("tokens_before"), so the queued cost is the total less
# the oldest unfinished entry's "tokens_before". Each priority class has its stream
# (shared.ingress); in one, the first unfinished entry is the oldest pending one (an entry is
# pending until dispatched), else the first never delivered; the oldest over all classes
# counts (an overestimate where a better class was served past an older entry of a worse
# one: those count as queued until it goes). Entries a router re-queued carry no count
# (their tokens were paid for once) and are skipped. Returns {accepted 0/1, queued cost, total}.
# The status hash gets no TTL here: a request's records live as long as the request, and
# whoever ends it (shared.request_log.mark_ended) sets the TTL, which starts at the end.
POLL_S = 0.05  # a cluster's wait for runs across slots: a read this often

ENQUEUE_LUA = """
local stream, counter, meta, classes = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local limit, cost, base = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[6]
local total = 0
if limit > 0 then total = tonumber(redis.call('GET', counter) or '0') end

-- The first unfinished entry of one class's stream (an XRANGE start), or nil when it has none.
local function first_unfinished(s)
  if redis.call('EXISTS', s) == 0 then return nil end
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', s)) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    if info['name'] == ARGV[1] then
      if tonumber(info['pending']) > 0 then return redis.call('XPENDING', s, ARGV[1])[2] end
      return '(' .. info['last-delivered-id']
    end
  end
  return '-'
end

-- The "tokens_before" of a class's first unfinished entry that has one, or nil.
local function before(s)
  local start = first_unfinished(s)
  for _, count in ipairs({1, 8, 64, 256}) do  -- usually the first entry has its count
    if not start then return nil end
    local entries = redis.call('XRANGE', s, start, '+', 'COUNT', count)
    for _, e in ipairs(entries) do
      for i = 1, #e[2], 2 do
        if e[2][i] == 'tokens_before' then return tonumber(e[2][i + 1]) end
      end
    end
    start = #entries > 0 and ('(' .. entries[#entries][1]) or nil
  end
  return nil
end

-- Queued: everything after the oldest unfinished entry of any class (streams named as Keys.requests).
local function queued()
  local oldest = nil
  local names = {base}
  for _, p in ipairs(redis.call('ZRANGE', classes, 0, -1)) do
    if p ~= '0' then names[#names + 1] = base .. ':' .. p end
  end
  for _, s in ipairs(names) do
    local b = before(s)
    if b and (not oldest or b < oldest) then oldest = b end
  end
  if not oldest then return 0 end
  return math.max(0, total - oldest)
end

local backlog = -1
if limit > 0 then
  backlog = queued()
  -- An empty queue takes any request, so one larger than the limit is not refused forever.
  if backlog > 0 and backlog + cost > limit then return {0, backlog, total} end
end
total = redis.call('INCRBY', counter, cost) - cost  -- an integer reply: never a float's printing
redis.call('HSET', meta, unpack(ARGV, 8))
if ARGV[7] ~= '0' then redis.call('ZADD', classes, ARGV[7], ARGV[7]) end  -- class 0 is always read
redis.call('XADD', stream, '*', ARGV[4], ARGV[5], 'tokens_before', total)
return {1, backlog, total}
"""


@dataclass(frozen=True)
class Enqueued:
    accepted: bool
    queued_tokens: int  # the backlog before this request; -1 when not measured (no limit)
    total_tokens: int  # cost ever enqueued before this request


async def enqueue(
    redis: aioredis.Redis,
    keys: Keys,
    request: GenerateRequest,
    ttl_s: int,
    *,
    cost: int = 0,
    max_queue_tokens: int = 0,
    key_hash: str | None = None,
) -> Enqueued:
    """Create the status hash (queued, no TTL until the request ends) and the ingress entry,
    unless the backlog is full. ``ttl_s`` is unused: kept so callers need not change."""
    meta = RequestMeta.fields(
        status=RequestStatus.QUEUED,
        prompt_tokens=request.num_prompt_tokens,
        max_new_tokens=request.params.max_new_tokens,
        created_ms=request.created_ms,
        key_hash=key_hash,
        samples=request.n if request.n > 1 else None,
    )
    args = [ROUTER_GROUP, max_queue_tokens, cost, codec.FIELD, codec.encode(request)]
    args += [keys.requests(), request.priority]  # the class-0 stream's name: the others add ':PRIORITY'
    args += [item for pair in meta.items() for item in pair]
    script = redis.register_script(ENQUEUE_LUA)  # cheap: EVALSHA, loaded again after a Redis restart
    accepted, queued, total = await script(
        keys=[keys.requests(request.priority), keys.enqueued_tokens(), keys.meta(request.id), keys.classes()],
        args=args,
    )
    return Enqueued(bool(accepted), int(queued), int(total))


# The cancel key of a live request (status hash without a TTL) must outlive any wait for its
# holder, so it gets no TTL: ending the request gives it one (mark_ended TTLs every request
# key). One set after the end (status hash with a TTL, or gone) gets the TTL at once.
CANCEL_LUA = """
redis.call('SET', KEYS[2], '1')
if redis.call('TTL', KEYS[1]) ~= -1 then redis.call('EXPIRE', KEYS[2], ARGV[1]) end
"""


async def request_cancel(redis: aioredis.Redis, keys: Keys, request_id: str, ttl_s: int) -> None:
    """Ask whoever holds the request (router or worker) to finalise it as cancelled."""
    script = redis.register_script(CANCEL_LUA)
    await script(keys=[keys.meta(request_id), keys.cancel(request_id)], args=[ttl_s])


async def read_meta(redis: aioredis.Redis, keys: Keys, request_id: str) -> RequestMeta | None:
    """The status hash; None when it is gone or has no ``status`` (what remains of an expired or
    lost record once a late writer touched it): such a request is unknown, not malformed."""
    return meta_or_none(await redis.hgetall(keys.meta(request_id)))


async def queue_place(
    redis: aioredis.Redis, keys: Keys, request_id: str, model: str | None
) -> tuple[int | None, int | None]:
    """A queued request's (priority, position) in the routers' order (``router.order.ordering``): requests
    of better classes waiting for its model, plus those before it in its class (of any model).
    (None, None) until a router has read it (it waits in the stream's lag) or once it left the
    queue. Two reads, not one snapshot: a guide."""
    priority = await redis.zscore(keys.waiting(model), request_id)
    if priority is None:
        return None, None
    p = int(priority)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zcount(keys.waiting(model), "-inf", f"({p}")
        pipe.zrank(keys.order(p), request_id)
        better, rank = await pipe.execute()
    return p, None if rank is None else better + rank


def meta_or_none(data: dict[str, str]) -> RequestMeta | None:
    if not data or "status" not in data:
        return None
    return RequestMeta.from_hash(data)


def parse_entries(entries: list) -> list[StreamEntry]:
    return [(entry_id, parse_run(fields)) for entry_id, fields in entries]


async def read_range(
    redis: aioredis.Redis, keys: Keys, request_id: str, first: str = "-", last: str = "+"
) -> list[StreamEntry]:
    """Runs already in the stream between two entry ids (inclusive)."""
    return parse_entries(await redis.xrange(keys.chunks(request_id), min=first, max=last))


async def read_after(
    redis: aioredis.Redis, keys: Keys, request_id: str, after: str, block_ms: int | None
) -> list[StreamEntry]:
    """Runs after ``after``, waiting up to ``block_ms`` (None: not at all) when there are none yet."""
    reply = await redis.xread({keys.chunks(request_id): after}, block=block_ms)
    if not reply:
        return []
    return [item for _stream, entries in reply for item in parse_entries(entries)]


async def read_many_after(
    redis: aioredis.Redis, keys: Keys, after: dict[str, str], block_ms: int | None
) -> list[tuple[str, str, ChunkRun]]:
    """(request id, entry id, run) after each request's ``after[id]``, in one XREAD over their streams."""
    by_key = {keys.chunks(request_id): request_id for request_id in after}
    streams = {keys.chunks(request_id): last for request_id, last in after.items()}
    if client_is_cluster(redis):  # one XREAD per slot; none can block across them: poll
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while not (reply := await xread_spread(redis, streams)) and time.monotonic() < deadline:
            await asyncio.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
    else:
        reply = await redis.xread(streams, block=block_ms)
    return [
        (by_key[stream], entry_id, run) for stream, entries in reply or [] for entry_id, run in parse_entries(entries)
    ]
