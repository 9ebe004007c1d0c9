"""The order requests are served in: priority classes strictly, then fair shares of tokens between tenants.

The rule. A request's place is ``(priority, tag, ingress id)``, smallest first:

- ``priority`` (lower first, as in vLLM): a class is served only when no
  better class has a request for the same model waiting anywhere, whichever
  router holds it (the dispatch script checks ``waiting``, a sorted set per
  served model that every router shares; per model, as a request only its
  model's workers can take must not hold up another model's pool).
- ``tag``: the request's virtual start in its class, start-time fair queuing
  over token counts. Each tenant has a virtual finish ``F`` per class, each
  class a virtual time ``V`` (the largest tag dispatched in it). A request
  gets ``S = max(V, F[tenant])`` and moves its tenant's ``F`` to
  ``S + cost / weight``. A flooding tenant's tags run ahead at the rate it
  sends, so a tenant sending less is served at the same token rate as long
  as it has work: the virtual token counters of "Fairness in Serving Large
  Language Models" (OSDI 2024). The ``max`` with ``V`` is that paper's lift:
  a tenant that was idle does not bank credit and then starve the others.
- the ingress id (arrival order) breaks ties.

Why tags, not counters read at each decision: a tag is assigned once, in
Redis, atomically (``TAG_LUA``), the first time any router reads the entry,
and kept in the class's ``order`` sorted set until the request is
dispatched or ends. So two routers order the same requests the same way,
and a restarted router (or one that claims a dead router's entries) finds
the tags it had. Counters read per decision would differ between routers
deciding at the same moment.

The cost charged is the request's prompt plus ``max_new_tokens`` per open
sample, known at enqueue (the paper counts tokens as they are generated;
lightq's router never sees them). A request that stops early is charged its
budget; all tenants are charged the same way.

A requeued request (worker death, drain, preemption) is a new ingress
entry and is tagged again, charged for what it still has to run.

Bounded state. Tenants can be anyone (OpenAI's ``user`` without keys), so a
class keeps fair-share records (``vtc``) of at most ``--max_tenants``
tenants: a request whose tenant has none when its class is full is charged
to the ``other`` tenant, for its tag and its counters (``default``,
``other`` and the tenants named in ``--tenant_weights`` always get their
own). The router that tags it notes ``charged_to`` in its status hash, so
a router that reads it again charges it alike. Records that no longer
change any tag are dropped again (``router.order.tenant_records``).
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Iterable, Iterator

import redis

from shared import ingress
from shared.keys import Keys, class_tenant_field
from shared.peak import ReqState
from shared.schemas import DEFAULT_TENANT, OTHER_TENANT, GenerateRequest, RequestStatus

log = logging.getLogger("lightq.router")

# KEYS: vtime, tenant_queued, then per item: order(priority), vtc(priority), waiting(model), meta
# ARGV: most tenants a class keeps records of, the overflow tenant, its weight; then per item:
#       request id, priority, tenant, cost, weight, 1 if the tenant always gets a record of its own
# Returns per item {tag, the tenant charged}; the tag as a string (a Lua number would be truncated
# to an integer reply).
TAG_LUA = """
local cap, other, other_weight = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
-- A tenant's finish tag, a class's virtual time and the queued counts are read once per call and
-- written once at its end (a read's entries are mostly a few tenants'): per entry, three commands.
local out, vtimes, finish, added, queued = {}, {}, {}, {}, {}
for i = 0, (#KEYS - 2) / 4 - 1 do
  local order, vtc, waiting, meta = KEYS[3 + 4 * i], KEYS[4 + 4 * i], KEYS[5 + 4 * i], KEYS[6 + 4 * i]
  local a = 4 + 6 * i
  local rid, prio, tenant = ARGV[a], ARGV[a + 1], ARGV[a + 2]
  local cost, weight, own = tonumber(ARGV[a + 3]), tonumber(ARGV[a + 4]), ARGV[a + 5] == '1'
  local tag = redis.call('ZSCORE', order, rid)
  if tag then  -- read before (a restart, a dead router's entry): charged as then
    tenant = redis.call('HGET', meta, 'charged_to') or tenant
  else
    local held = finish[vtc] or {}
    finish[vtc] = held
    if held[tenant] == nil then
      held[tenant] = {redis.call('HGET', vtc, tenant), false}
      if held[tenant][1] == false and not own then  -- a new record: is there room for it?
        if redis.call('HLEN', vtc) + (added[vtc] or 0) >= cap then
          held[tenant] = nil
          tenant, weight = other, other_weight
          if redis.call('EXISTS', meta) == 1 then  -- never a hash without its TTL
            redis.call('HSET', meta, 'charged_to', other)
          end
          if held[tenant] == nil then held[tenant] = {redis.call('HGET', vtc, tenant), false} end
        end
      end
      if held[tenant][1] == false then added[vtc] = (added[vtc] or 0) + 1 end
    end
    if vtimes[prio] == nil then vtimes[prio] = tonumber(redis.call('HGET', KEYS[1], prio) or '0') end
    local s = math.max(vtimes[prio], tonumber(held[tenant][1] or '0'))
    held[tenant] = {string.format('%.17g', s + cost / weight), true}
    redis.call('ZADD', order, s, rid)
    redis.call('ZADD', waiting, prio, rid)
    local member = prio .. ':' .. tenant
    queued[member] = (queued[member] or 0) + 1
    tag = string.format('%.17g', s)
  end
  out[i + 1] = {tag, tenant}
end
for vtc, held in pairs(finish) do
  for tenant, f in pairs(held) do
    if f[2] then redis.call('HSET', vtc, tenant, f[1]) end
  end
end
for member, n in pairs(queued) do redis.call('HINCRBY', KEYS[2], member, n) end
return out
"""


# A request slot and nothing else: no tokens held, none to come (``ignore_eos``: its length is exact).
SLOT = ReqState(held=0, generated=0, max_new_tokens=0, ignore_eos=1)


def reserved_slots(n: int) -> tuple[ReqState, ...]:
    """``--priority_reserve_slots``: a request of priority > 0 is checked as if it came with ``n``
    empty requests, so it fits only where ``n`` request slots stay free after it (the worker's
    ``running_max_req_size`` counts requests, these take no tokens). Without preemption, a
    request of priority <= 0 arriving at a full pool waits for a slot to free and for the worker's
    next heartbeat to say so; the reserve trades the slots' idle time for that wait."""
    return (SLOT,) * n


def parse_weights(text: str) -> dict[str, float]:
    """``--tenant_weights`` ('a=2,b=0.5'; the setting's pattern checked the form) as a dict."""
    weights = {}
    for item in filter(None, text.split(",")):
        tenant, _, weight = item.partition("=")
        if float(weight) <= 0:
            raise ValueError(f"tenant_weights: {tenant}'s weight must be > 0, got {weight}")
        weights[tenant] = float(weight)
    return weights


def cost(request: GenerateRequest) -> int:
    """Tokens a request is charged: its prompt (and what it already emitted), and its budget per open sample."""
    return request.num_prompt_tokens + request.num_emitted + request.params.max_new_tokens * len(request.open_choices)


class Tagger:
    """Assigns (or finds) the tags of entries a router takes, in one round trip per read, and the
    tenant each is charged to (its own, or ``other`` past ``max_tenants``)."""

    def __init__(self, client: redis.Redis, keys: Keys, weights: dict[str, float], max_tenants: int = 1000):
        self.keys, self.weights, self.max_tenants = keys, weights, max_tenants
        self.script = client.register_script(TAG_LUA)

    def tags(self, requests: list[GenerateRequest]) -> list[tuple[float, GenerateRequest]]:
        """Each request's tag, and the request as it is charged (``tenant`` replaced by ``other``
        when its class had no room for its tenant): what the router holds and dispatches."""
        if not requests:
            return []
        keys = [self.keys.vtime(), self.keys.tenant_queued()]
        args: list = [self.max_tenants, OTHER_TENANT, self.weights.get(OTHER_TENANT, 1.0)]
        for r in requests:
            keys += [self.keys.order(r.priority), self.keys.vtc(r.priority), self.keys.waiting(r.model)]
            keys += [self.keys.meta(r.id)]
            own = r.tenant in self.weights or r.tenant in (DEFAULT_TENANT, OTHER_TENANT)
            args += [r.id, r.priority, r.tenant, cost(r), self.weights.get(r.tenant, 1.0), int(own)]
        out = []
        for r, (tag, tenant) in zip(requests, self.script(keys=keys, args=args)):
            tenant = _text(tenant)
            out.append((float(tag), r if tenant == r.tenant else r.model_copy(update={"tenant": tenant})))
        return out


# KEYS: the class's order, waiting, tenant_queued; ARGV: request id, "priority:tenant"
FORGET_LUA = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 and redis.call('HINCRBY', KEYS[3], ARGV[2], -1) <= 0 then
  redis.call('HDEL', KEYS[3], ARGV[2])
end
redis.call('ZREM', KEYS[2], ARGV[1])
"""


def forget(pipe: redis.client.Pipeline, keys: Keys, request: GenerateRequest) -> None:
    """A queued request ended without a dispatch (cancelled, expired): out of the order.

    Goes in the same transaction as the entry's XACK, so the order never keeps a request the
    stream no longer holds. The tenant's count drops only if the request was in the order.
    """
    forget_parts(pipe, keys, request.id, request.priority, request.model, request.tenant)


def forget_parts(
    pipe: redis.client.Pipeline, keys: Keys, request_id: str, priority: int, model: str | None, tenant: str
) -> None:
    """``forget`` from the parts the order keeps (a parked entry's: ``router.order.parking``)."""
    order_keys = [keys.order(priority), keys.waiting(model), keys.tenant_queued()]
    pipe.eval(FORGET_LUA, len(order_keys), *order_keys, request_id, class_tenant_field(priority, tenant))


def clear_if_gone(client: redis.Redis, keys: Keys, request_id: str, model: str | None) -> None:
    """A request in ``waiting`` whose record is gone or ended can never be dispatched: out with it,
    or every lower class would wait on it forever. Only a path that acks an ingress entry without
    ``forget`` could leave one behind; none does, this is the safety net."""
    status = client.hget(keys.meta(request_id), "status")
    if status is not None and not RequestStatus(_text(status)).is_terminal:
        return
    priority = client.zscore(keys.waiting(model), request_id)
    if priority is not None:
        log.warning("request %s was left in the order after it ended: removed", request_id)
        client.zrem(keys.order(int(priority)), request_id)
        client.zrem(keys.waiting(model), request_id)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _entry_order(handle: str) -> tuple[int, int]:
    ms, _, seq = ingress.entry_id(handle).partition("-")
    return int(ms), int(seq or 0)


class OrderedQueue:
    """What one router holds, kept in the rule's order; iterates as ``(entry_id, request)``.

    At most ``order_window`` entries, so inserting by bisection (O(n) moves of pointers)
    is cheaper than any heap bookkeeping would be.
    """

    def __init__(self) -> None:
        self._keys: list[tuple] = []
        self._items: list[tuple[str, GenerateRequest]] = []
        self._tags: dict[str, float] = {}
        self._tenants: Counter[tuple[int, str]] = Counter()  # (priority, tenant) -> entries held

    def add(self, entry_id: str, request: GenerateRequest, tag: float) -> None:
        key = (request.priority, tag, _entry_order(entry_id))
        at = bisect.bisect(self._keys, key)
        self._keys.insert(at, key)
        self._items.insert(at, (entry_id, request))
        self._tags[entry_id] = tag
        self._tenants[request.priority, request.tenant] += 1

    def put_back(self, items: Iterable[tuple[str, GenerateRequest]]) -> None:
        """Entries taken off the head and not dispatched: back in their places."""
        for entry_id, request in items:
            self.add(entry_id, request, self._tags[entry_id])

    def popleft(self) -> tuple[str, GenerateRequest]:
        # The tag stays until the entry leaves for good (``drop``): a popped entry may come back.
        self._keys.pop(0)
        entry_id, request = self._items.pop(0)
        self._tenants[request.priority, request.tenant] -= 1
        if not self._tenants[request.priority, request.tenant]:
            del self._tenants[request.priority, request.tenant]
        return entry_id, request

    def remove(self, entry_ids: set[str]) -> None:
        """Entries anywhere in the queue taken out for good (cancelled or expired while waiting)."""
        kept = [(key, item) for key, item in zip(self._keys, self._items) if item[0] not in entry_ids]
        for entry_id, request in self._items:
            if entry_id in entry_ids:
                self._tenants[request.priority, request.tenant] -= 1
                if not self._tenants[request.priority, request.tenant]:
                    del self._tenants[request.priority, request.tenant]
                self._tags.pop(entry_id, None)
        self._keys, self._items = [k for k, _ in kept], [i for _, i in kept]

    def tenant_count(self, priority: int, tenant: str) -> int:
        """Entries of one tenant in one class (``router.order.parking``)."""
        return self._tenants.get((priority, tenant), 0)

    def drop(self, entry_id: str) -> None:
        self._tags.pop(entry_id, None)

    def count(self, priority: int) -> int:
        """Entries of one class: the keys sort by class first, so two bisections."""
        return bisect.bisect_left(self._keys, (priority + 1,)) - bisect.bisect_left(self._keys, (priority,))

    def __getitem__(self, index: int) -> tuple[str, GenerateRequest]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[tuple[str, GenerateRequest]]:
        return iter(list(self._items))  # a copy: the metrics thread iterates while the loop changes it
