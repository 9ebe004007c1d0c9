"""Writes to a request's records that router and worker share.

A request's output lives in two places written together: the durable chunk
stream (read by the producer, replayable, the source for migration) and the
pub/sub channel (live, lossy, for external subscribers). Ending a request
sets its status, TTLs its records and appends a terminal chunk.
"""

from __future__ import annotations

import time

import redis

from shared.codec import FIELD, encode, from_entry
from shared.keys import Keys
from shared.schemas import FinishReason, RequestMeta, RequestStatus, TokenChunk


def now_ms() -> int:
    return int(time.time() * 1000)


def append_chunk(pipe: redis.client.Pipeline, keys: Keys, chunk: TokenChunk) -> None:
    data = encode(chunk)  # once: the stream entry and the pub/sub message carry the same JSON
    pipe.xadd(keys.chunks(chunk.request_id), {FIELD: data})
    pipe.publish(keys.channel(chunk.request_id), data)


def end_request(
    pipe: redis.client.Pipeline,
    keys: Keys,
    request_id: str,
    *,
    status: RequestStatus,
    reason: FinishReason,
    num_output: int,
    ttl_s: int,
    error: str | None = None,
) -> None:
    """Terminal chunk (no token) + final status + TTLs, queued on ``pipe``."""
    append_chunk(
        pipe,
        keys,
        TokenChunk(
            request_id=request_id, index=num_output, token_id=None, finished=True, finish_reason=reason, error=error
        ),
    )
    mark_ended(pipe, keys, request_id, status=status, reason=reason, num_output=num_output, ttl_s=ttl_s, error=error)


def mark_ended(
    pipe: redis.client.Pipeline,
    keys: Keys,
    request_id: str,
    *,
    status: RequestStatus,
    reason: FinishReason,
    num_output: int,
    ttl_s: int,
    error: str | None = None,
) -> None:
    pipe.hset(
        keys.meta(request_id),
        mapping=RequestMeta.fields(
            status=status, finish_reason=reason, output_tokens=num_output, finished_ms=now_ms(), error=error
        ),
    )
    for key in keys.all_request_keys(request_id):
        pipe.expire(key, ttl_s)


def emitted_chunks(client: redis.Redis, keys: Keys, request_id: str) -> list[TokenChunk]:
    """The request's chunks so far, each (choice, index) once, by choice then index (first copy wins)."""
    seen: dict[tuple[int, int], TokenChunk] = {}
    for _, fields in client.xrange(keys.chunks(request_id)):
        chunk = from_entry(TokenChunk, fields)
        seen.setdefault((chunk.choice, chunk.index), chunk)
    return [seen[k] for k in sorted(seen)]


def has_ended(chunks: list[TokenChunk], n: int) -> bool:
    """Whether these chunks end the request: each of its ``n`` choices finished, or a
    chunk without a token (cancelled, failed, expired) ended them all."""
    if any(c.finished and c.token_id is None for c in chunks):
        return True
    return len({c.choice for c in chunks if c.finished}) >= n
