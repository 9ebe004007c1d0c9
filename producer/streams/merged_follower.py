"""Several requests' chunk streams followed as one: a completion of several prompts.

OpenAI's ``/v1/completions`` takes a list of prompts and answers one
response whose choices are numbered prompt-major: choice ``i * n + j`` is
sample j of prompt i. lightq queues each prompt as a request of its own (a
group when n > 1), so they may run on different workers; this reader
follows them all with one XREAD over their streams, each through its own
``ChunkFollower`` (which drops repeats and knows when its request ended),
and renumbers each chunk's ``choice`` into the combined response.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from producer import store
from producer.redis_client import with_reconnect
from producer.streams.streaming import Check, ChunkFollower
from shared.chunk_schemas import ChunkRun, TokenChunk


class MergedFollower:
    """Followers of requests that answer prompts 0..P-1, with ``n`` choices each."""

    def __init__(self, followers: list[ChunkFollower]) -> None:
        first = followers[0]
        self.followers = followers
        self.redis, self.keys, self.block_ms, self.outage_s = first.redis, first.keys, first.block_ms, first.outage_s
        self.index = {f.request_id: i for i, f in enumerate(followers)}
        self.ends_only = False  # set by ``collect``: woken when a request's sample ends, not per run

    @property
    def finished(self) -> bool:
        return all(f.finished for f in self.followers)

    @property
    def request_ids(self) -> list[str]:
        return [f.request_id for f in self.followers]

    async def follow(self, disconnected: Check | None = None) -> AsyncIterator[tuple[str | None, TokenChunk]]:
        """(entry id, chunk numbered in the combined response) until every request ended."""
        try:
            async for item in self._follow(disconnected):
                yield item
        finally:
            if self.followers[0].hub is not None:
                self.followers[0].hub.leave(self.request_ids)

    async def _follow(self, disconnected: Check | None) -> AsyncIterator[tuple[str | None, TokenChunk]]:
        while not self.finished:
            if disconnected is not None and await disconnected():
                return
            entries = await with_reconnect(self._read_next, self.outage_s)
            if not entries:  # quiet: a request may have ended without a terminal chunk
                for i, follower in enumerate(self.followers):
                    if not follower.finished:
                        for chunk in await with_reconnect(follower.ending_without_chunk, self.outage_s):
                            yield None, self._numbered(i, chunk)
                continue
            for request_id, entry_id, run in entries:
                i = self.index[request_id]
                self.followers[i].last_id = entry_id
                for event_id, chunk in self.followers[i].accept(entry_id, run):
                    yield event_id, self._numbered(i, chunk)

    async def _read_next(self) -> list[tuple[str, str, ChunkRun]]:
        after = {f.request_id: f.last_id for f in self.followers if not f.finished}
        hub = self.followers[0].hub
        if hub is not None:
            return await hub.read_many(after, self.block_ms, self.ends_only, all(f.own for f in self.followers))
        return await store.read_many_after(self.redis, self.keys, after, self.block_ms)

    def _numbered(self, prompt: int, chunk: TokenChunk) -> TokenChunk:
        return chunk.model_copy(update={"choice": prompt * self.followers[prompt].n + chunk.choice})
