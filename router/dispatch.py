"""One dispatch: a request into a worker's inbox, checked against every router's dispatches.

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

The script also refuses a worker whose load record has expired: the
janitor may be emptying that inbox (it reaps only workers without a
record), and an entry appended after it did would never be read.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from router.admission import request_states
from shared.codec import FIELD, encode, from_entry
from shared.keys import ROUTER_GROUP, Keys
from shared.peak import ReqState
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta

# KEYS: inbox, load record, ingress stream, status hash
# ARGV: tail, most entries to return, group, ingress entry id, field, message, then status field/value pairs
DISPATCH_LUA = """
if redis.call('EXISTS', KEYS[2]) == 0 then return {-1} end
local newer = redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
if #newer > 0 then return {0, newer} end
local id = redis.call('XADD', KEYS[1], '*', ARGV[5], ARGV[6])
redis.call('HSET', KEYS[4], unpack(ARGV, 7))
redis.call('XACK', KEYS[3], ARGV[3], ARGV[4])
return {1, id}
"""
MAX_NEWER = 256  # entries handed back per conflict; the router asks again for more


@dataclass(frozen=True)
class Outcome:
    inbox_id: str | None = None  # set: dispatched
    newer: list[tuple[str, tuple[ReqState, ...]]] | None = None  # set: not written, learn these and decide again
    # neither: the worker's record expired; leave it to the janitor


class Dispatcher:
    def __init__(self, client: redis.Redis, keys: Keys):
        self.client, self.keys = client, keys
        self.script = client.register_script(DISPATCH_LUA)  # EVALSHA, reloaded after a Redis restart

    def send(self, worker_id: str, tail: str, entry_id: str, request: GenerateRequest) -> Outcome:
        meta = RequestMeta.fields(worker=worker_id, dispatched_ms=now_ms())
        args = [tail, MAX_NEWER, ROUTER_GROUP, entry_id, FIELD, encode(request)]
        args += [x for pair in meta.items() for x in pair]
        status, *rest = self.script(keys=[self.keys.inbox(worker_id), self.keys.load(worker_id),
                                          self.keys.requests(), self.keys.meta(request.id)], args=args)
        if status == 1:
            return Outcome(inbox_id=_text(rest[0]))
        if status == 0:
            return Outcome(newer=[(_text(i), _state(flat)) for i, flat in rest[0]])
        return Outcome()


def _state(flat: list) -> tuple[ReqState, ...]:
    """A raw entry's field list as the summaries its worker will publish."""
    fields = {_text(k): v for k, v in zip(flat[::2], flat[1::2])}
    return request_states(from_entry(GenerateRequest, fields))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
