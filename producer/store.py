"""The producer's side of the Redis protocol (see shared/keys.py for the layout).

The producer writes a request's status hash and its ingress entry, sets the
cancel key, and reads the status hash and the durable chunk stream. It never
reads the pub/sub channel: the stream has every chunk, in order, resumable.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared import codec
from shared.keys import Keys
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, TokenChunk

StreamEntry = tuple[str, TokenChunk]  # (stream entry id, chunk)


async def enqueue(redis: aioredis.Redis, keys: Keys, request: GenerateRequest, ttl_s: int) -> None:
    """Create the status hash (queued) and the ingress entry in one transaction."""
    meta = RequestMeta.fields(
        status=RequestStatus.QUEUED,
        prompt_tokens=request.num_prompt_tokens,
        max_new_tokens=request.params.max_new_tokens,
        created_ms=request.created_ms,
    )
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.meta(request.id), mapping=meta)
        pipe.expire(keys.meta(request.id), ttl_s)
        pipe.xadd(keys.requests(), codec.entry(request))
        await pipe.execute()


async def request_cancel(redis: aioredis.Redis, keys: Keys, request_id: str, ttl_s: int) -> None:
    """Ask whoever holds the request (router or worker) to finalise it as cancelled."""
    await redis.set(keys.cancel(request_id), "1", ex=ttl_s)


async def read_meta(redis: aioredis.Redis, keys: Keys, request_id: str) -> RequestMeta | None:
    data = await redis.hgetall(keys.meta(request_id))
    return RequestMeta.from_hash(data) if data else None


def parse_entries(entries: list) -> list[StreamEntry]:
    return [(entry_id, codec.from_entry(TokenChunk, fields)) for entry_id, fields in entries]


async def read_range(redis: aioredis.Redis, keys: Keys, request_id: str,
                     first: str = "-", last: str = "+") -> list[StreamEntry]:
    """Chunks already in the stream between two entry ids (inclusive)."""
    return parse_entries(await redis.xrange(keys.chunks(request_id), min=first, max=last))


async def read_after(redis: aioredis.Redis, keys: Keys, request_id: str,
                     after: str, block_ms: int | None) -> list[StreamEntry]:
    """Chunks after ``after``, waiting up to ``block_ms`` (None: not at all) when there are none yet."""
    reply = await redis.xread({keys.chunks(request_id): after}, block=block_ms)
    if not reply:
        return []
    return [item for _stream, entries in reply for item in parse_entries(entries)]
