"""A flush's control script only where it has control work (issue 30: the control slot's primary)."""

from shared.chunk_schemas import ChunkRun
from worker.service.chunk_writer import ChunkWriter, RequestWrite


class Recorder:
    """Stands in for the control script: counts its calls, writes nothing."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, keys, args, client) -> None:
        self.calls += 1
        client.echo("control")  # a reply in its place (the flush would fail on it: it is never sent)


def test_a_flush_of_runs_alone_sends_no_control_script(rclient, keys):
    writer = ChunkWriter(rclient, keys, "w-1", ttl_s=60, history_len=8)
    writer.control = control = Recorder()
    run = ChunkRun(request_id="r-1", index=0, token_ids=[5], texts=["a"], logprobs=[None]).model_dump_json()
    out = writer.flush([RequestWrite("r-1", epoch=1, runs=[run])], lengths=[], released=[])
    assert out[0].written and control.calls == 0
    assert rclient.xlen(keys.chunks("r-1")) == 1
    rclient.expire(keys.chunks("r-1"), 60)


def test_a_flush_with_a_start_sends_it(rclient, keys):
    writer = ChunkWriter(rclient, keys, "w-1", ttl_s=60, history_len=8)
    rclient.hset(keys.meta("r-2"), "epoch", 1)
    rclient.expire(keys.meta("r-2"), 60)
    out = writer.flush([RequestWrite("r-2", epoch=1, start={"status": "running"})], lengths=[], released=[])
    assert out[0].written and rclient.hget(keys.meta("r-2"), "status") == "running"
    stale = writer.flush([RequestWrite("r-2", epoch=0, start={"status": "queued"})], lengths=[], released=[])
    assert not stale[0].written and rclient.hget(keys.meta("r-2"), "status") == "running"


def test_an_end_gives_a_cancel_that_raced_it_the_ttl(rclient, keys):
    """A cancel asked while the request ran (its key set without a TTL: the status hash had none) and
    an end by length: the key stayed for good until housekeeping found it (red team 5)."""
    writer = ChunkWriter(rclient, keys, "w-1", ttl_s=60, history_len=8)
    rclient.hset(keys.meta("r-3"), "epoch", 1)
    rclient.set(keys.cancel("r-3"), "1")
    out = writer.flush([RequestWrite("r-3", epoch=1, end={"status": "finished"})], lengths=[], released=[])
    assert out[0].written
    assert 0 < rclient.ttl(keys.cancel("r-3")) <= 60 and 0 < rclient.ttl(keys.meta("r-3")) <= 60
