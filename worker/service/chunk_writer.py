"""A publisher's writes, one Redis round trip per flush: runs, starts and ends, fenced per request.

A flush is one pipeline of scripts (``shared.keys``' two planes): per request group with runs (on
one server, one for every group), a **data** script that appends each request's run to its chunk
stream and publishes it where someone listens; per producer woken, an XADD to its wake stream; then
one **control** script that sets ``running`` on a start, the final status and TTLs on an end, takes
a new epoch on a fence, pushes the finished samples' output lengths and acknowledges the inbox
entries released here (a flush with none of these sends none: issue 30's control slot). One
server runs the pipeline in one round trip; a cluster client sends each node its share at once.
Data before control: a status hash that says a request ended has its last chunk behind it.

A token costs Redis one share of an XADD (its run's) and nothing per token.

**Listeners.** Per data script, ``PUBSUB NUMSUB`` (``SHARDNUMSUB`` on a cluster, whose channels are
sharded: SPUBLISH) of its channels with runs, and on one server ``NUMPAT`` (a pattern subscriber
hears every request): a run is published only where someone listens, from the run after a
subscription, as with plain pub/sub.

**Wakes.** Per producer whose requests it wrote (``GenerateRequest.reply_to``), a flush appends their
ids to the producer's wake stream (``Keys.wake``), so its stream hub reads just those streams
(``producer.streams.stream_hub``). NOMKSTREAM: a producer that is gone has no stream, and gets none.

**Fencing** (``shared.request_log``): a request's writes are refused when its epoch is no longer
the one this worker got. The data script refuses a run whose epoch is not past the request's data
fence (``Keys.data_fence``, in the group's slot: a fence raises it before it reads the chunks as
final); the control script refuses a start, end or fence whose epoch is not the status hash's.
Both are reads inside the scripts (one MGET of the data fences per data script, an HGET per
request in the control script): no round trip of their own.

A retry after a lost reply (the publisher retries through an outage) may repeat a run: readers drop
repeated indexes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import redis

from shared.codec import FIELD
from shared.keys import WORKER_GROUP, Keys, group
from shared.redis import client_is_cluster, publish_command

# One request group's runs (on one server: every group's). KEYS per request: chunk stream, data
# fence. ARGV: entry field, TTL s, publish command, NUMSUB subcommand, '1' to ask NUMPAT (one
# server), then per request: epoch, channel, 1 if it ends here (its stream gets the TTL), a count
# and that many runs. Returns the places (1-based) of the requests refused.
DATA_LUA = """
local field, ttl, publish, numsub = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local everyone = ARGV[5] == '1' and redis.call('PUBSUB', 'NUMPAT') > 0
local channels, a = {}, 6
while a <= #ARGV do
  channels[#channels + 1] = ARGV[a + 1]
  a = a + 4 + tonumber(ARGV[a + 3])
end
local heard = {}
if not everyone then
  local counts = redis.call('PUBSUB', numsub, unpack(channels))
  for c = 1, #channels do heard[c] = counts[2 * c] > 0 end
end
local fences = {}
for k = 2, #KEYS, 2 do fences[#fences + 1] = KEYS[k] end
fences = redis.call('MGET', unpack(fences))
local refused, k, place = {}, 1, 0
a = 6
while a <= #ARGV do
  local chunks = KEYS[k]
  local epoch, channel, ends, nruns = ARGV[a], ARGV[a + 1], ARGV[a + 2], tonumber(ARGV[a + 3])
  place, k = place + 1, k + 2
  local fenced = fences[place]
  if fenced and tonumber(epoch) <= tonumber(fenced) then
    refused[#refused + 1] = place
  else
    for r = a + 4, a + 3 + nruns do
      redis.call('XADD', chunks, '*', field, ARGV[r])
      if everyone or heard[place] then redis.call(publish, channel, ARGV[r]) end
    end
    if ends == '1' then redis.call('EXPIRE', chunks, ttl) end
  end
  a = a + 4 + nruns
end
return refused
"""

# The control plane's share. KEYS[1] the output-length list, KEYS[2] the worker's inbox, then per
# request: status hash, cancel key. ARGV[1] TTL s, [2] output-length history size, [3] inbox group,
# then a count and that many output lengths, a count and that many inbox ids, then per request:
# epoch, flags (letters: x expire the cancel key, f fence after), a count and that many start
# fields, a count and that many end fields.
# Returns {refused requests' places (1-based), {place, new epoch} of each fence}.
CONTROL_LUA = """
local ttl, keep, group = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = tonumber(ARGV[4])
if n > 0 then
  redis.call('LPUSH', KEYS[1], unpack(ARGV, 5, 4 + n))
  redis.call('LTRIM', KEYS[1], 0, keep - 1)
end
local a = 5 + n
n = tonumber(ARGV[a])
if n > 0 then
  redis.call('XACK', KEYS[2], group, unpack(ARGV, a + 1, a + n))
  redis.call('XDEL', KEYS[2], unpack(ARGV, a + 1, a + n))
end
a = a + n + 1
local refused, fences, k, place = {}, {}, 3, 0
while a <= #ARGV do
  local meta, cancel = KEYS[k], KEYS[k + 1]
  local epoch, flags, nstart = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local first_start = a + 3
  local nend = tonumber(ARGV[first_start + nstart])
  local first_end = first_start + nstart + 1
  a = first_end + nend
  k, place = k + 2, place + 1
  if (redis.call('HGET', meta, 'epoch') or '0') ~= epoch then
    refused[#refused + 1] = place
  else
    if nstart > 0 then redis.call('HSET', meta, unpack(ARGV, first_start, first_start + nstart - 1)) end
    if nend > 0 then
      redis.call('HSET', meta, unpack(ARGV, first_end, first_end + nend - 1))
      redis.call('EXPIRE', meta, ttl)
      redis.call('EXPIRE', cancel, ttl)  -- a cancel that raced the end too (a no-op where none was asked)
    end
    if string.find(flags, 'f', 1, true) then
      fences[#fences + 1] = {place, redis.call('HINCRBY', meta, 'epoch', 1)}
    end
  end
end
return {refused, fences}
"""


@dataclass
class RequestWrite:
    """What one flush writes for one request, in this order: start, runs, end, fence."""

    request_id: str
    epoch: int
    start: dict[str, str] = field(default_factory=dict)  # status hash fields of 'running'
    runs: list[str] = field(default_factory=list)  # ChunkRun JSON, in order
    end: dict[str, str] = field(default_factory=dict)  # the final status hash fields
    fence: bool = False  # take a new epoch after these writes (a preemption hands it back)
    reply_to: str | None = None  # the producer to wake (GenerateRequest.reply_to)


@dataclass(frozen=True)
class Written:
    """A request's outcome: ``written`` False when its epoch moved on (nothing was written);
    ``epoch`` the new one after a fence."""

    written: bool
    epoch: int


class ChunkWriter:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, ttl_s: int, history_len: int):
        self.client, self.keys = client, keys
        self.inbox = keys.inbox(worker_id)
        self.ttl_s, self.history_len = ttl_s, history_len
        self.cluster = client_is_cluster(client)
        self.publish = publish_command(client)
        self.data = client.register_script(DATA_LUA)  # EVALSHA, loaded again after a Redis restart
        self.control = client.register_script(CONTROL_LUA)

    def flush(self, writes: list[RequestWrite], lengths: list[int], released: list[str]) -> list[Written]:
        """One round trip: ``writes`` in order, output ``lengths`` to the history, ``released`` inbox ids."""
        # One data script per request group on a cluster (a script's keys share a slot); on one
        # server, one for them all: its listener and fence reads are then one command per flush.
        groups: dict[int, list[int]] = defaultdict(list)  # request group -> places in writes (0-based)
        for place, w in enumerate(writes):
            if w.runs:
                groups[group(w.request_id) if self.cluster else 0].append(place)
        control = [place for place, w in enumerate(writes) if w.start or w.end or w.fence]
        producers = list(dict.fromkeys(w.reply_to for w in writes if w.reply_to is not None and w.runs))
        replies = self._pipeline(writes, groups, control, producers, lengths, released)
        refused: set[int] = set()
        for places, reply in zip(groups.values(), replies):
            refused.update(places[p - 1] for p in reply)
        control_refused, fences = replies[-1] if replies[-1] is not None else ([], [])
        refused.update(control[p - 1] for p in control_refused)
        epochs = {control[p - 1]: int(e) for p, e in fences}
        return [Written(place not in refused, epochs.get(place, 0)) for place in range(len(writes))]

    def _pipeline(self, writes, groups, control, producers, lengths, released) -> list:
        """Data scripts (one per group), wake XADDs, the control script; NoScript (a server that
        restarted or a replica promoted since the scripts were loaded) loads them and sends again."""
        for attempt in (1, 2):
            pipe = self.client.pipeline(transaction=False)
            for places in groups.values():
                self._data_call(pipe, [writes[p] for p in places])
            for producer in producers:
                ids = " ".join(w.request_id for w in writes if w.reply_to == producer and w.runs)
                pipe.xadd(self.keys.wake(producer), {"r": ids}, maxlen=10_000, approximate=True, nomkstream=True)
            # A flush of runs alone (many of them, mid-burst) sends no control script: it would
            # write nothing, and cost the control slot's primary a call per flush (issue 30).
            has_control = bool(control or lengths or released)
            if has_control:
                self._control_call(pipe, [writes[p] for p in control], lengths, released)
            try:
                replies = pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt == 2:
                    raise
                self.client.script_load(DATA_LUA), self.client.script_load(CONTROL_LUA)
                continue
            return replies[: len(groups)] + (replies[-1:] if has_control else [None])
        raise AssertionError("unreachable")

    def _data_call(self, pipe, writes: list[RequestWrite]) -> None:
        keys: list[str] = []
        args: list[str | int] = [FIELD, self.ttl_s, self.publish, "SHARDNUMSUB" if self.cluster else "NUMSUB"]
        args.append("0" if self.cluster else "1")
        for w in writes:
            keys += [self.keys.chunks(w.request_id), self.keys.data_fence(w.request_id)]
            args += [w.epoch, self.keys.channel(w.request_id), 1 if w.end else 0, len(w.runs), *w.runs]
        self.data(keys=keys, args=args, client=pipe)

    def _control_call(self, pipe, writes: list[RequestWrite], lengths: list[int], released: list[str]) -> None:
        keys = [self.keys.output_lengths(), self.inbox]
        args: list[str | int] = [self.ttl_s, self.history_len, WORKER_GROUP]
        args += [len(lengths), *lengths, len(released), *released]
        for w in writes:  # those with a start, an end or a fence: runs alone are the data plane's
            keys += [self.keys.meta(w.request_id), self.keys.cancel(w.request_id)]
            args += [w.epoch, _flags(w), 2 * len(w.start), *_flat(w.start), 2 * len(w.end), *_flat(w.end)]
        self.control(keys=keys, args=args, client=pipe)


def _flags(w: RequestWrite) -> str:
    return "f" if w.fence else "-"


def _flat(fields: dict[str, str]) -> list[str]:
    return [item for pair in fields.items() for item in pair]
