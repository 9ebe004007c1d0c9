"""Reading a request's chunk stream, in either format.

Workers write format 2 (``ChunkRun``: one entry per run of tokens); format 1
(``TokenChunk``: one entry per token) is what workers before it wrote, and
readers take both, so producers can be upgraded before workers. Readers see
tokens: a run is its ``TokenChunk``s. A repeated (choice, index) is dropped
where it matters (the follower, the resume): only a writer that the pool
fenced out could have written it, and the first copy is the one delivered.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import redis
from pydantic import Field, TypeAdapter

from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.codec import FIELD
from shared.keys import Keys

_ENTRY: TypeAdapter[ChunkRun | TokenChunk] = TypeAdapter(Annotated[ChunkRun | TokenChunk, Field(discriminator="kind")])


def parse_run(fields: Mapping[Any, str | bytes]) -> ChunkRun:
    """A chunk stream entry as a run (format 1's one token is a run of one)."""
    raw = fields.get(FIELD) if FIELD in fields else fields.get(FIELD.encode())
    if raw is None:
        raise ValueError(f"stream entry has no {FIELD!r} field: {list(fields)}")
    message = _ENTRY.validate_json(raw)
    return message if isinstance(message, ChunkRun) else ChunkRun.of(message)


def emitted_chunks(client: redis.Redis, keys: Keys, request_id: str) -> list[TokenChunk]:
    """The request's chunks so far, each (choice, index) once, by choice then index (first copy wins)."""
    seen: dict[tuple[int, int], TokenChunk] = {}
    for _, fields in client.xrange(keys.chunks(request_id)):
        for chunk in parse_run(fields).tokens():
            seen.setdefault((chunk.choice, chunk.index), chunk)
    return [seen[k] for k in sorted(seen)]


def has_ended(chunks: list[TokenChunk], n: int) -> bool:
    """Whether these chunks end the request: each of its ``n`` choices finished, or a
    chunk without a token (cancelled, failed, expired) ended them all."""
    if any(c.finished and c.token_id is None for c in chunks):
        return True
    return len({c.choice for c in chunks if c.finished}) >= n
