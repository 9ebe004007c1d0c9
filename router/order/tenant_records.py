"""Per-tenant state kept bounded: fair-share records dropped once they no longer change any tag,
and the tokens-dispatched counters of tenants gone idle folded into ``other``.

A tenant's record in a class is its virtual finish ``F`` (``router.order.ordering``); its next request
gets the tag ``max(V, F)``, ``V`` the class's virtual time, and a tenant without a record is
tagged as if ``F`` were 0, i.e. at ``V`` (tags and ``V`` are never negative). ``V`` never goes
down (the dispatch script only raises it), so once ``F <= V`` the record is dead weight: every
later tag is ``max(V', F) = V' = max(V', 0)`` for the ``V' >= V`` of that moment. Dropping it
changes no tag, exactly (tests/router/test_tenant_records.py checks the orders of the same
requests with and without drops). A tenant with requests queued in the class keeps its record
even then, so every tenant counted in ``tenant_queued`` has one, and that hash is bounded by
the records' bound.

Why ``F <= V`` is enough to stay bounded, not only tidy: a class holds at most ``--max_tenants``
records (new tenants past them are charged to ``other``, ``router.order.ordering``). Records that never
reach ``F <= V`` would pin them, but ``V`` moves up whenever a request tagged above it is
dispatched, and ``other``'s tags climb by each request charged to it; so while new tenants are
turned away, ``V`` passes the idle records' ``F`` and they go. An idle tenant loses nothing by
it; a flooding one keeps its record as long as its tags run ahead.

``tenant_served`` (tokens dispatched per class and tenant, for metrics) only ever grows by
dispatches: once a class has more than ``--max_tenants`` counters, those of tenants without a
record (idle), smallest first, are added to the class's ``other`` and deleted, so its sum over a
class never goes down. Bounds per class, N = ``--max_tenants`` and X the tenants that always
get a record (``default``, ``other``, the weighted ones): ``vtc`` and ``tenant_queued`` at most
N + X fields; ``tenant_served`` at most N + X + 1 after a pass, and 2N + X + 1 at any time (only
a tenant with a record gets a counter, and records are dropped only by a pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shared import ingress
from shared.keys import Keys
from shared.schemas import OTHER_TENANT

# KEYS: vtime, tenant_queued, tenant_served, then per class: vtc
# ARGV: most counters a class keeps, the overflow tenant, then per class: priority
# Returns {records dropped, counters folded}.
COMPACT_LUA = """
local vtime, queued, served = KEYS[1], KEYS[2], KEYS[3]
local cap, other = tonumber(ARGV[1]), ARGV[2]
local dropped, folded = 0, 0
local counters = {}  -- priority -> {{tenant, tokens}, ...}
local flat = redis.call('HGETALL', served)
for j = 1, #flat, 2 do
  local at = string.find(flat[j], ':', 1, true)
  local prio = string.sub(flat[j], 1, at - 1)
  counters[prio] = counters[prio] or {}
  table.insert(counters[prio], {string.sub(flat[j], at + 1), tonumber(flat[j + 1])})
end
for i = 4, #KEYS do
  local vtc, prio = KEYS[i], ARGV[i - 1]
  local v = tonumber(redis.call('HGET', vtime, prio) or '0')
  local records = redis.call('HGETALL', vtc)
  for j = 1, #records, 2 do
    local tenant = records[j]
    if tonumber(records[j + 1]) <= v and redis.call('HEXISTS', queued, prio .. ':' .. tenant) == 0 then
      redis.call('HDEL', vtc, tenant)
      dropped = dropped + 1
    end
  end
  local rows = counters[prio] or {}
  if #rows > cap then
    local idle = {}
    for _, row in ipairs(rows) do
      if row[1] ~= other and redis.call('HEXISTS', vtc, row[1]) == 0 then
        table.insert(idle, row)
      end
    end
    table.sort(idle, function(x, y) return x[2] < y[2] end)
    for j = 1, math.min(#idle, #rows - cap) do
      redis.call('HINCRBY', served, prio .. ':' .. other, idle[j][2])
      redis.call('HDEL', served, prio .. ':' .. idle[j][1])
      folded = folded + 1
    end
  end
end
return {dropped, folded}
"""


@dataclass(frozen=True)
class Compacted:
    dropped: int  # fair-share records that changed no tag any more
    folded: int  # idle tenants' counters added to ``other``


class TenantRecords:
    """One pass over every class, in one script call (atomic with tagging and dispatches)."""

    def __init__(self, client: redis.Redis, keys: Keys, max_tenants: int):
        self.client, self.keys, self.max_tenants = client, keys, max_tenants
        self.script = client.register_script(COMPACT_LUA)

    def compact(self) -> Compacted:
        classes = [priority for priority, _ in ingress.streams(self.client, self.keys)]
        keys = [self.keys.vtime(), self.keys.tenant_queued(), self.keys.tenant_served()]
        keys += [self.keys.vtc(priority) for priority in classes]
        dropped, folded = self.script(keys=keys, args=[self.max_tenants, OTHER_TENANT, *classes])
        return Compacted(int(dropped), int(folded))
