"""Dispatches: requests into workers' inboxes, each checked against every router's dispatches.

The router decides on its copy of the worker's inbox tail
(``router.reservations``); this script writes the decision only if the
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

The script also refuses a worker whose load record has expired: the
janitor may be emptying that inbox (it reaps only workers without a
record), and an entry appended after it did would never be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shared.admission import request_states
from shared.codec import FIELD, encode, from_entry
from shared.keys import ROUTER_GROUP, Keys
from shared.peak import ReqState
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta

# KEYS: the ingress stream, then per item: inbox, load record, status hash
# ARGV: group, most newer entries to return, message field, then per item:
#       tail, ingress entry id, message, number of status args, status field/value pairs
# Per item: {1, id} written; {0, newer} not written, newer entries; {-1} record expired;
# {2} not tried, as an earlier item to the same inbox was not written (order per inbox holds).
DISPATCH_LUA = """
local group, max_newer, field = ARGV[1], ARGV[2], ARGV[3]
local tails, blocked, out = {}, {}, {}
local a = 4
for i = 0, (#KEYS - 1) / 3 - 1 do
  local inbox, load, meta = KEYS[2 + 3 * i], KEYS[3 + 3 * i], KEYS[4 + 3 * i]
  local tail, entry, msg, nstatus = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  local status = {unpack(ARGV, a + 4, a + 3 + nstatus)}
  a = a + 4 + nstatus
  if blocked[inbox] then
    out[i + 1] = {2}
  elseif redis.call('EXISTS', load) == 0 then
    blocked[inbox] = true
    out[i + 1] = {-1}
  else
    local newer = redis.call('XRANGE', inbox, '(' .. (tails[inbox] or tail), '+', 'COUNT', max_newer)
    if #newer > 0 then
      blocked[inbox] = true
      out[i + 1] = {0, newer}
    else
      local id = redis.call('XADD', inbox, '*', field, msg)
      redis.call('HSET', meta, unpack(status))
      redis.call('XACK', KEYS[1], group, entry)
      tails[inbox] = id  -- our own entry: not a conflict for the next item to this inbox
      out[i + 1] = {1, id}
    end
  end
end
return out
"""
MAX_NEWER = 256  # entries handed back per conflict; the router asks again for more


@dataclass(frozen=True)
class Outcome:
    inbox_id: str | None = None  # set: dispatched
    newer: list[tuple[str, tuple[ReqState, ...]]] | None = None  # set: not written, learn these and decide again
    # neither: the worker's record expired; leave it to the janitor


@dataclass(frozen=True)
class Item:
    worker_id: str
    tail: str  # the newest inbox entry the router accounted for
    entry_id: str  # the ingress entry to acknowledge
    request: GenerateRequest


class Dispatcher:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.client, self.keys = client, keys
        self.script = client.register_script(DISPATCH_LUA)  # EVALSHA, reloaded after a Redis restart

    def send_many(self, items: list[Item]) -> list[Outcome]:
        """Several dispatches in one round trip, each checked as if sent alone, in order."""
        keys, args = [self.keys.requests()], [ROUTER_GROUP, MAX_NEWER, FIELD]
        for item in items:
            status = RequestMeta.fields(worker=item.worker_id, dispatched_ms=now_ms())
            keys += [self.keys.inbox(item.worker_id), self.keys.load(item.worker_id), self.keys.meta(item.request.id)]
            args += [item.tail, item.entry_id, encode(item.request), 2 * len(status)]
            args += [x for pair in status.items() for x in pair]
        return [_outcome(reply) for reply in self.script(keys=keys, args=args)]


def _outcome(reply: list) -> Outcome:
    status, *rest = reply
    if status == 1:
        return Outcome(inbox_id=_text(rest[0]))
    if status == 0:
        return Outcome(newer=[(_text(i), _state(flat)) for i, flat in rest[0]])
    if status == 2:
        return Outcome(newer=[])  # not tried: decide again
    return Outcome()


def _state(flat: list) -> tuple[ReqState, ...]:
    """A raw entry's field list as the summaries its worker will publish."""
    fields = {_text(k): v for k, v in zip(flat[::2], flat[1::2])}
    return request_states(from_entry(GenerateRequest, fields))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
