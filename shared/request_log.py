"""Writes to a request's records from outside its worker, fenced: the router, the janitor, requeues.

A request's output lives in two places written together: the durable chunk
stream (read by the producer, replayable, the source for migration) and the
pub/sub channel (live, lossy, for external subscribers). Ending a request
sets its status, TTLs its records and appends a terminal chunk.

**Fencing.** The status hash carries the request's ``epoch``, a number that
only grows: every dispatch takes a new one (``router.dispatch``) and hands it
to the worker with the request, and whoever takes a request back from a
worker (a requeue after the worker died or drained, a preemption, an end by
a router) moves it on first (``fence``). A worker's writes carry the epoch it
got, and the script that writes them (``worker.service.chunk_writer``)
refuses any other, atomically with the write: a worker the pool gave up on
(killed, frozen, cut off), or its orphaned publisher, can no longer write a
single chunk or status for a request that moved on. A terminal status
never goes back: ``fence`` refuses an ended request, and so ``requeue`` never
sends one back (an operator's ``lightq dead-letters requeue`` is the one
deliberate exception).
"""

from __future__ import annotations

import time

import redis

from shared.chunk_schemas import ChunkRun
from shared.codec import FIELD, encode
from shared.keys import FENCE_TTL_S, Keys
from shared.redis import publish_command
from shared.schemas import FinishReason, RequestMeta, RequestStatus

TERMINAL = tuple(s.value for s in RequestStatus if s.is_terminal)
ENDED, LOST = -1, -2  # what ``fence`` returns instead of an epoch

# KEYS[1] the status hash; ARGV the terminal statuses. The new epoch; ENDED when the request already
# ended; LOST when its record has no status (expired, or a Redis that came back empty).
FENCE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -2 end
for _, s in ipairs(ARGV) do if status == s then return -1 end end
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
"""

# Raise a request's data fence (never lower it). KEYS[1] the data fence; ARGV: epoch, TTL s.
DATA_FENCE_LUA = """
if tonumber(redis.call('GET', KEYS[1]) or '0') < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
end
"""

# End a request from outside its worker: its status. KEYS: status hash, cancel key. ARGV: TTL s,
# expected epoch ('': a record without status, LOST), then status field/value pairs. 1 written;
# 0 refused (its epoch moved on, or it ended).
END_LUA = """
local meta, cancel, ttl, expected = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
if expected ~= '' and (redis.call('HGET', meta, 'epoch') or '0') ~= expected then return 0 end
redis.call('HSET', meta, unpack(ARGV, 3))
redis.call('EXPIRE', meta, ttl)
redis.call('EXPIRE', cancel, ttl)
return 1
"""

# Its terminal run, after the status. KEYS: chunk stream. ARGV: entry field, run, TTL s, publish
# command, channel.
END_RUN_LUA = """
redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[2])
redis.call(ARGV[4], ARGV[5], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
"""


def now_ms() -> int:
    return int(time.time() * 1000)


def fence(client: redis.Redis, keys: Keys, request_id: str) -> int:
    """Take the request from whoever holds it: a new epoch, so its holder's writes are refused from
    now on; or ENDED (it ended: nothing to take) or LOST (its record has no status).

    Two steps, as the status hash and the chunk stream are in two slots (``shared.keys``): the status
    hash's epoch first (from then on the holder's starts and ends are refused), then the data fence
    (its runs). A run the holder writes between the two is in the stream before this returns: the
    chunks a caller reads after it are final."""
    epoch = int(client.register_script(FENCE_LUA)(keys=[keys.meta(request_id)], args=list(TERMINAL)))
    # Epoch 1: it was 0, no dispatch ever took one, so no worker ever held the request and none can
    # write its runs: no data fence (it lives a week; every request that expired or was cancelled in
    # the queue left one, ~200 bytes each, a red team's soak).
    if epoch > 1:
        raise_data_fence(client, keys, request_id, epoch)
    return epoch


def raise_data_fence(client: redis.Redis, keys: Keys, request_id: str, epoch: int) -> None:
    """From now on the request's runs are written only with an epoch past ``epoch``."""
    client.register_script(DATA_FENCE_LUA)(keys=[keys.data_fence(request_id)], args=[epoch, FENCE_TTL_S])


def end_request(
    client: redis.Redis,
    keys: Keys,
    request_id: str,
    *,
    status: RequestStatus,
    reason: FinishReason,
    num_output: int,
    ttl_s: int,
    error: str | None = None,
    epoch: int | None = None,
) -> bool:
    """Final status + TTLs, then the terminal run (no token); False when refused. ``epoch``: the one
    a ``fence`` returned (refused if it moved on since); None fences here, unless the request
    already ended."""
    if epoch is None:
        epoch = fence(client, keys, request_id)
        if epoch == ENDED:
            return False
    run = ChunkRun(request_id=request_id, index=num_output, finished=True, finish_reason=reason, error=error)
    fields = RequestMeta.fields(
        status=status, finish_reason=reason, output_tokens=num_output, finished_ms=now_ms(), error=error
    )
    args = [ttl_s, "" if epoch == LOST else epoch, *(item for pair in fields.items() for item in pair)]
    if not client.register_script(END_LUA)(keys=keys.control_request_keys(request_id), args=args):
        return False
    args = [FIELD, encode(run), ttl_s, publish_command(client), keys.channel(request_id)]
    client.register_script(END_RUN_LUA)(keys=[keys.chunks(request_id)], args=args)
    return True


def mark_finished(
    client: redis.Redis,
    keys: Keys,
    request_id: str,
    *,
    reason: FinishReason,
    num_output: int,
    ttl_s: int,
) -> None:
    """The status of a request whose chunks ended it but whose status write was lost."""
    pipe = client.pipeline(transaction=False)  # two slots (shared.keys); each write is idempotent
    pipe.hset(
        keys.meta(request_id),
        mapping=RequestMeta.fields(
            status=RequestStatus.FINISHED, finish_reason=reason, output_tokens=num_output, finished_ms=now_ms()
        ),
    )
    for key in keys.all_request_keys(request_id):
        pipe.expire(key, ttl_s)
    pipe.execute()
