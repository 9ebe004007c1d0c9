"""The producer's stream hub: one blocked XREAD for every followed chunk stream (real Redis)."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio as aioredis

from producer.streams.stream_hub import StreamHub, hub_name
from shared.chunk_schemas import TokenChunk
from shared.codec import entry
from shared.keys import Keys

LONG_BLOCK_MS = 60_000  # a stream that joined must not wait for this: the hub unblocks its read


def chunk(request_id: str, index: int) -> dict[str, str]:
    return entry(TokenChunk(request_id=request_id, index=index, token_id=100 + index, text=f"t{index}"))


def blocked_xreads(rclient: redis.Redis, keys: Keys) -> int:
    """The hub's blocked XREADs (by its client name: other tests' readers may share this Redis)."""
    return sum(
        1 for c in rclient.client_list() if c["cmd"] == "xread" and "b" in c["flags"] and c["name"] == hub_name(keys)
    )


async def until(condition, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_many_followers_share_one_blocked_read_and_each_gets_its_own_chunks(aredis, rclient, redis_settings):
    keys = Keys(redis_settings.key_prefix)
    hub = StreamHub(aredis, keys, LONG_BLOCK_MS)
    ids = [f"{i:032x}" for i in range(8)]
    try:
        readers = [asyncio.create_task(hub.read_many({rid: "0-0"}, 30_000)) for rid in ids]
        await until(lambda: blocked_xreads(rclient, keys) == 1)
        await asyncio.sleep(0.05)
        assert blocked_xreads(rclient, keys) == 1  # not one per follower
        for i, rid in enumerate(ids):
            await aredis.xadd(keys.chunks(rid), chunk(rid, i))
        for i, (rid, reader) in enumerate(zip(ids, readers)):
            got = await reader
            assert [(r, c.index, c.token_ids) for r, _, c in got] == [(rid, i, [100 + i])]  # format 1, as a run of one
    finally:
        await hub.close()


async def test_a_stream_that_joins_while_the_read_blocks_is_read_at_once(rclient, redis_settings):
    keys = Keys(redis_settings.key_prefix)
    aredis = aioredis.Redis.from_url(
        redis_settings.url, decode_responses=True, socket_timeout=None
    )  # waits for the block
    hub = StreamHub(aredis, keys, LONG_BLOCK_MS)
    first, late = "a" * 32, "b" * 32
    try:
        waiting = asyncio.create_task(hub.read_many({first: "0-0"}, 30_000))
        await until(lambda: blocked_xreads(rclient, keys) == 1)
        late_read = asyncio.create_task(hub.read_many({late: "0-0"}, 30_000))
        await asyncio.sleep(0.05)
        await aredis.xadd(keys.chunks(late), chunk(late, 0))
        # Without CLIENT UNBLOCK the hub's read would not include ``late`` for a minute: this read
        # would time out after 30 s with nothing.
        assert [c.index for _, _, c in await late_read] == [0]
        await aredis.xadd(keys.chunks(first), chunk(first, 0))
        assert [c.index for _, _, c in await waiting] == [0]
    finally:
        await hub.close()
        await aredis.aclose()


async def test_reads_continue_after_the_last_entry_and_skip_unreadable_ones(aredis, redis_settings):
    keys = Keys(redis_settings.key_prefix)
    hub = StreamHub(aredis, keys, 1000)
    rid = "c" * 32
    try:
        await aredis.xadd(keys.chunks(rid), chunk(rid, 0))
        await aredis.xadd(keys.chunks(rid), {"msg": "not json"})
        await aredis.xadd(keys.chunks(rid), chunk(rid, 1))
        got = await hub.read_many({rid: "0-0"}, 5000)
        assert [c.index for _, _, c in got] == [0, 1]
        await aredis.xadd(keys.chunks(rid), chunk(rid, 2))
        got = await hub.read_many({rid: got[-1][1]}, 5000)
        assert [c.index for _, _, c in got] == [2]
        assert await hub.read_many({rid: got[-1][1]}, 50) == []  # quiet: the caller checks the status hash
    finally:
        await hub.close()


async def test_a_stream_left_is_read_no_more(aredis, redis_settings):
    keys = Keys(redis_settings.key_prefix)
    hub = StreamHub(aredis, keys, 1000)
    rid = "d" * 32
    try:
        await hub.read_many({rid: "0-0"}, 10)
        hub.leave([rid])
        await aredis.xadd(keys.chunks(rid), chunk(rid, 0))
        await asyncio.sleep(0.1)
        assert rid not in hub._streams
    finally:
        await hub.close()


async def test_own_streams_are_read_when_a_wake_names_them_and_a_lost_wake_costs_one_wait(rclient, redis_settings):
    """Streams of requests submitted here are out of the blocking read: a wake entry (what a
    publisher's flush appends) names those to read, and only those are read. A stream whose wake
    never comes is read again after its reader waited ``block_ms``: late, never lost."""
    keys = Keys(redis_settings.key_prefix)
    aredis = aioredis.Redis.from_url(redis_settings.url, decode_responses=True, socket_timeout=None)
    hub = StreamHub(aredis, keys, LONG_BLOCK_MS, wake_id="p1")
    ids = [f"{i:032x}" for i in range(20)]
    try:
        readers = {rid: asyncio.create_task(hub.read_many({rid: "0-0"}, 30_000, own=True)) for rid in ids}
        await until(lambda: blocked_xreads(rclient, keys) == 1)
        await asyncio.sleep(0.05)
        await aredis.xadd(keys.chunks(ids[3]), chunk(ids[3], 0))
        await asyncio.sleep(0.3)
        assert not readers[ids[3]].done()  # its stream is not in the blocking read: only its wake is
        await aredis.xadd(keys.wake("p1"), {"r": ids[3]})
        assert [c.index for _, _, c in await readers[ids[3]]] == [0]
        assert not any(readers[rid].done() for rid in ids if rid != ids[3])
        await aredis.xadd(keys.chunks(ids[5]), chunk(ids[5], 0))  # no wake: lost
        late = asyncio.create_task(hub.read_many({ids[5]: "0-0"}, 200, own=True))
        readers[ids[5]].cancel()
        assert [c.index for _, _, c in await late] == [0]  # after one 200 ms wait, read directly
    finally:
        for task in readers.values():
            task.cancel()
        await hub.close()
        await aredis.delete(keys.wake("p1"), *(keys.chunks(rid) for rid in ids))
        await aredis.aclose()
