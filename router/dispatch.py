"""Dispatches: requests into workers' inboxes, each checked against every router's dispatches.

The router decides on its copy of the worker's inbox tail
(``router.workers.reservations``); this script writes the decision only if the
copy is still complete, i.e. the inbox holds no entry after the ``tail``
the router knows of. Then, atomically, it appends the request to the
inbox, records the worker in the status hash and acknowledges the ingress
entry (a crash before leaves the entry pending, after it the request is in
exactly one inbox). Otherwise it writes nothing and returns the newer
entries, so the router learns them and decides again: optimistic
concurrency on the ledger itself, which needs no key of its own and no
cleanup.

Only new entries conflict: the worker's XREADGROUP, XACK and XDEL of
entries it took in never do, so a single router never retries. Each
conflict hands over at least one entry another router did write, so the
retries of a decision are bounded by the other routers' progress.

One call carries a step's whole run of decisions (one round trip, not one
per request); each item is checked as if it were sent alone, and after an
item to some inbox is not written, the later items to that inbox are not
tried either, so a worker's requests stay in the router's order.

Priority classes are strict across routers: an item is not written while a
request of a better class for the same model waits in the shared ``waiting``
set (whichever router holds it), and nothing after it in the call is tried; the router
waits for that request to go first. A written item leaves the order and
its tenant is charged its tokens, in the same script (``router.order.ordering``).

The script also refuses a worker whose load record has expired: the
janitor may be emptying that inbox (it reaps only workers without a
record), and an entry appended after it did would never be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from router.order.ordering import cost
from shared import ingress
from shared.codec import FIELD, encode, from_entry
from shared.keys import ROUTER_GROUP, Keys, class_tenant_field
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta

# KEYS: vtime, tenant_queued, tenant_served, then per item: inbox, load record, status hash,
#       the class's order, the model's waiting set (router.order.ordering), the entry's ingress stream
# ARGV: group, most newer entries to return, message field, then per item:
#       tail, ingress entry id, message, request id, priority, "priority:tenant", cost,
#       number of status args, status field/value pairs
# Per item: {1, id} written; {0, newer} not written, newer entries; {-1} record expired;
# {2} not tried, as an earlier item to the same inbox was not written (order per inbox holds);
# {3, id} not written: request ``id`` of a better class waits (strict classes, router.order.ordering),
# and no later item of the call is tried either; {4} not written: the request is in an inbox
# already (this entry is a copy; acknowledged and out of the order).
DISPATCH_LUA = """
local group, max_newer, field = ARGV[1], ARGV[2], ARGV[3]
local vtime, queued, served = KEYS[1], KEYS[2], KEYS[3]
local tails, blocked, out, stop = {}, {}, {}, false
-- Within this script only its own writes change what it reads, so a check passed once stays
-- passed: no better-class request appears in a waiting set (it only loses the ones sent here),
-- and an inbox it appended to has nothing newer than its own entry. Virtual times are written
-- once at the end. (One call carries a burst's run: this keeps it to a few commands per item.)
local clear, vtimes, unqueued, charged = {}, {}, {}, {}
local a = 4
for i = 0, (#KEYS - 3) / 6 - 1 do
  local inbox, load, meta = KEYS[4 + 6 * i], KEYS[5 + 6 * i], KEYS[6 + 6 * i]
  local order, waiting, ingress = KEYS[7 + 6 * i], KEYS[8 + 6 * i], KEYS[9 + 6 * i]
  local tail, entry, msg, rid = ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local prio, member, cost, nstatus = ARGV[a + 4], ARGV[a + 5], ARGV[a + 6], tonumber(ARGV[a + 7])
  local status = {unpack(ARGV, a + 8, a + 7 + nstatus)}
  a = a + 8 + nstatus
  local better = {}
  if not stop and not blocked[inbox] and not clear[waiting .. ' ' .. prio] then
    better = redis.call('ZRANGEBYSCORE', waiting, '-inf', '(' .. prio, 'LIMIT', 0, 1)
    if #better == 0 then clear[waiting .. ' ' .. prio] = true end
  end
  if stop then
    out[i + 1] = {2}
  elseif blocked[inbox] then
    out[i + 1] = {2}
  elseif #better > 0 then
    stop = true
    out[i + 1] = {3, better[1]}
  elseif not tails[inbox] and redis.call('EXISTS', load) == 0 then
    blocked[inbox] = true
    out[i + 1] = {-1}
  elseif redis.call('HEXISTS', meta, 'worker') == 1 then
    -- Another entry of a request an inbox holds (whoever takes a request back removes its worker
    -- first: shared.requeue): a copy a crash left behind. Dropped, so a request is in one inbox at
    -- a time and only one worker holds a live epoch; an ended request keeps its worker, and so
    -- never runs again either.
    redis.call('XACK', ingress, group, entry)
    if redis.call('ZREM', order, rid) == 1 then unqueued[member] = (unqueued[member] or 0) + 1 end
    redis.call('ZREM', waiting, rid)
    out[i + 1] = {4}
  else
    local newer = {}
    if not tails[inbox] then
      newer = redis.call('XRANGE', inbox, '(' .. tail, '+', 'COUNT', max_newer)
    end
    if #newer > 0 then
      blocked[inbox] = true
      out[i + 1] = {0, newer}
    else
      -- A new epoch (shared.request_log): the worker writes this request's chunks with it alone.
      local epoch = redis.call('HINCRBY', meta, 'epoch', 1)
      local id = redis.call('XADD', inbox, '*', field, msg, 'epoch', epoch)
      redis.call('HSET', meta, unpack(status))
      redis.call('XACK', ingress, group, entry)
      tails[inbox] = id  -- our own entry: not a conflict for the next item to this inbox
      -- Out of the order; the class's virtual time moves to the largest tag served.
      local tag = redis.call('ZSCORE', order, rid)
      if redis.call('ZREM', order, rid) == 1 then unqueued[member] = (unqueued[member] or 0) + 1 end
      redis.call('ZREM', waiting, rid)
      charged[member] = (charged[member] or 0) + tonumber(cost)
      if tag then
        if vtimes[prio] == nil then vtimes[prio] = {redis.call('HGET', vtime, prio) or '0', false} end
        if tonumber(tag) > tonumber(vtimes[prio][1]) then vtimes[prio] = {tag, true} end
      end
      out[i + 1] = {1, id}
    end
  end
end
for prio, v in pairs(vtimes) do
  if v[2] then redis.call('HSET', vtime, prio, v[1]) end  -- the tag as ZSCORE gave it: no float printing
end
for member, n in pairs(unqueued) do
  if redis.call('HINCRBY', queued, member, -n) <= 0 then redis.call('HDEL', queued, member) end
end
for member, tokens in pairs(charged) do redis.call('HINCRBY', served, member, tokens) end
return out
"""
MAX_NEWER = 256  # entries handed back per conflict; the router asks again for more


@dataclass(frozen=True)
class Outcome:
    inbox_id: str | None = None  # set: dispatched
    newer: list[tuple[str, GenerateRequest]] | None = None  # set: not written, learn these and decide again
    behind: str | None = None  # set: not written, this request of a better class waits somewhere
    duplicate: bool = False  # not written: another entry of the request is in an inbox (this one is gone)
    # neither: the worker's record expired; leave it to the janitor


@dataclass(frozen=True)
class Item:
    worker_id: str
    tail: str  # the newest inbox entry the router accounted for
    entry_id: str  # the ingress entry to acknowledge (``shared.ingress.handle``: in its class's stream)
    request: GenerateRequest


class Dispatcher:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.client, self.keys = client, keys
        self.script = client.register_script(DISPATCH_LUA)  # EVALSHA, reloaded after a Redis restart

    def send_many(self, items: list[Item]) -> list[Outcome]:
        """Several dispatches in one round trip, each checked as if sent alone, in order."""
        k = self.keys
        keys = [k.vtime(), k.tenant_queued(), k.tenant_served()]
        args = [ROUTER_GROUP, MAX_NEWER, FIELD]
        for item in items:
            r = item.request
            status = RequestMeta.fields(worker=item.worker_id, dispatched_ms=now_ms())
            keys += [k.inbox(item.worker_id), k.load(item.worker_id), k.meta(r.id)]
            stream, entry_id = ingress.locate(k, item.entry_id)
            keys += [k.order(r.priority), k.waiting(r.model), stream]
            args += [item.tail, entry_id, encode(r), r.id, r.priority]
            args += [class_tenant_field(r.priority, r.tenant)]
            args += [cost(r), 2 * len(status)]
            args += [x for pair in status.items() for x in pair]
        return [_outcome(reply) for reply in self.script(keys=keys, args=args)]


def _outcome(reply: list) -> Outcome:
    status, *rest = reply
    if status == 1:
        return Outcome(inbox_id=_text(rest[0]))
    if status == 0:
        return Outcome(newer=[(_text(i), _request(flat)) for i, flat in rest[0]])
    if status == 2:
        return Outcome(newer=[])  # not tried: decide again
    if status == 3:
        return Outcome(newer=[], behind=_text(rest[0]))
    if status == 4:
        return Outcome(duplicate=True)
    return Outcome()


def _request(flat: list) -> GenerateRequest:
    """A raw inbox entry's field list as its request."""
    fields = {_text(k): v for k, v in zip(flat[::2], flat[1::2])}
    return from_entry(GenerateRequest, fields)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
