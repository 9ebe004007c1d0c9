"""A quiet stream reads the status hash every STATUS_CHECK_EVERY-th quiet read (issue 30)."""

from producer import store
from producer.streams.streaming import STATUS_CHECK_EVERY, ChunkFollower
from shared.chunk_schemas import ChunkRun
from shared.keys import Keys
from shared.schemas import RequestMeta, RequestStatus


async def test_a_quiet_stream_reads_the_status_hash_every_few_quiet_reads(monkeypatch):
    reads = []

    async def read_meta(redis, keys, request_id):
        reads.append(request_id)
        return RequestMeta(status=RequestStatus.QUEUED)

    monkeypatch.setattr(store, "read_meta", read_meta)
    follower = ChunkFollower(None, Keys("p"), "r-1", block_ms=100)
    for _ in range(2 * STATUS_CHECK_EVERY):
        assert await follower.ending_without_chunk() == []
    assert len(reads) == 2
    run = ChunkRun(request_id="r-1", index=0, token_ids=[1], texts=["a"], logprobs=[None])
    follower.accept("1-0", run)  # a run: the quiet reads count from 0 again
    for _ in range(STATUS_CHECK_EVERY - 1):
        await follower.ending_without_chunk()
    assert len(reads) == 2
