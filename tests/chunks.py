"""Writing chunk streams in tests as workers do: format 2 runs (``append_chunk``: a run of one token,
``append_run``), and format 1 entries (``append_v1``), as workers before runs wrote them."""

from __future__ import annotations

import redis

from shared import codec
from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.keys import Keys


def append_run(pipe: redis.client.Pipeline, keys: Keys, run: ChunkRun) -> None:
    pipe.xadd(keys.chunks(run.request_id), codec.entry(run))
    pipe.publish(keys.channel(run.request_id), codec.encode(run))


def append_chunk(pipe: redis.client.Pipeline, keys: Keys, chunk: TokenChunk) -> None:
    append_run(pipe, keys, ChunkRun.of(chunk))


def append_v1(pipe: redis.client.Pipeline, keys: Keys, chunk: TokenChunk) -> None:
    pipe.xadd(keys.chunks(chunk.request_id), codec.entry(chunk))
