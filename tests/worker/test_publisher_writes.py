"""The publisher's writes against a real Redis: runs of tokens and when they are
written, writes refused by the epoch or a fence, publishing to listeners only,
a paused request's way back, an orphan giving up on a dead Redis; and the
publisher processes behind their pipes (its text: test_publisher.py)."""

from __future__ import annotations

import time
from multiprocessing.connection import wait

import pytest
import redis

from shared.chunks import parse_run
from shared.config import RedisSettings
from shared.embedded_redis import start_embedded_redis
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group
from shared.request_log import fence
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.waiting import MUST_HAPPEN_S
from tests.worker.test_publisher import (  # noqa: F401 (fixtures)
    RID,
    chunks,
    client,
    ids,
    publish,
    publisher,
    started,
    tokenizer,
    tokenizer_only,
    tokens,
)
from tests.worker.token_rows import pack
from worker.engine.events import Released, Started, Token
from worker.service.publisher import Publisher
from worker.service.publisher_process import PublisherDied, PublisherLink, owner


def wait_written(client, keys, request_id: str, count: int) -> None:
    """Until ``count`` tokens of the request are in its chunk stream: each XREAD blocks until the
    stream grows (the event), the loop bounded only as a hang guard."""
    deadline, last, seen = time.monotonic() + MUST_HAPPEN_S, "0-0", 0
    while seen < count:
        assert time.monotonic() < deadline, f"{request_id}: {seen} of {count} tokens written"
        for _, written in client.xread({keys.chunks(request_id): last}, block=1000) or []:
            seen += sum(len(parse_run(fields).tokens()) for _, fields in written)
            last = written[-1][0]


def entries(client, keys, request_id=RID) -> list[list[int]]:
    """The token ids of each entry (a run each)."""
    return [parse_run(fields).token_ids for _, fields in client.xrange(keys.chunks(request_id))]


@pytest.mark.parametrize("shards", [1, 3])
def test_the_publisher_processes_write_in_order_and_report_stops(
    redis_settings, client, keys, ids, shards, smollm2_tokenizer_dir
):
    """Every request is written once, in order, by the one shard that owns it, whichever it is."""
    link = PublisherLink(
        WorkerSettings(redis=redis_settings, publishers=shards, model=tokenizer_only(smollm2_tokenizer_dir)), "w1"
    )
    link.start()
    link.wait_ready()
    others = [f"{i:032d}" for i in range(6)]  # spread over the shards
    assert shards == 1 or len({owner(r, shards) for r in [RID, *others]}) == shards
    link.put(
        [
            started(["answer"]),
            *[
                Started(
                    GenerateRequest(id=r, prompt_ids=[1, 2, 3], created_ms=0, params=SamplingParams(max_new_tokens=16))
                )
                for r in others
            ],
        ]
    )
    for i in range(4):
        rows = [tokens(ids, i, i + 1)[0], *[Token(r, i, ids[i], -0.5, None) for r in others]]
        link.put([pack(rows)])
    # Wait on the stop's arrival, not the clock: the processes load a tokenizer first, which on a
    # loaded machine took over a minute (pytest's timeout bounds the wait).
    wait([shard.stops for shard in link.shards])
    stopped = link.take_stopped()
    for r in others:  # every shard wrote its rows: close() gives a shard still starting 60 s, then kills it
        wait_written(client, keys, r, 4)
    link.close()
    assert stopped == [(RID, 0, 0)]  # (id, choice, the epoch of the copy it stopped)
    assert [c.text for c in chunks(client, keys)] == [" The", " "]
    for r in others:
        assert [c.index for c in chunks(client, keys, r)] == [0, 1, 2, 3]
    assert [s.process.exitcode for s in link.shards] == [0] * shards
    for r in others:
        client.delete(keys.chunks(r), keys.meta(r))


def test_a_dead_publisher_process_is_reported(redis_settings, smollm2_tokenizer_dir):
    link = PublisherLink(
        WorkerSettings(redis=redis_settings, publishers=2, model=tokenizer_only(smollm2_tokenizer_dir)), "w1"
    )
    link.start()
    link.wait_ready()
    link.check()  # alive
    link.shards[1].process.kill()
    link.shards[1].process.join(30)
    with pytest.raises(PublisherDied):
        link.check()
    with pytest.raises(PublisherDied):
        link.put([started()])
    link.close()


@pytest.mark.timeout(180)  # without the bound it would retry forever
def test_an_orphaned_publisher_stops_retrying_a_dead_redis(redis_settings, tokenizer, monkeypatch):
    """Once its worker is gone, a write that cannot reach Redis is given up after ORPHAN_RETRY_S
    (its requests resume elsewhere), instead of retrying forever as an orphan."""
    import redis as redis_lib
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from worker.service import pending

    monkeypatch.setattr(pending, "ORPHAN_RETRY_S", 0.2)
    # Nothing listens on port 1. Without retries of the client's own (redis-py's default retries a
    # refused connection 3 times over ~5 s): each of the publisher's attempts fails at once.
    dead = redis_lib.Redis(port=1, socket_connect_timeout=0.05, retry=Retry(NoBackoff(), 0))
    alive = [True]
    orphan = Publisher(WorkerSettings(redis=redis_settings), dead, tokenizer, "w1", worker_alive=lambda: alive[0])
    alive[0] = False
    assert publish(orphan, [started(), *tokens([5, 6, 7], 0, 2)]) == []  # returned: given up


def flushing(redis_settings, client, tokenizer, flush_ms: float) -> Publisher:
    settings = WorkerSettings(redis=redis_settings, stream_flush_ms=flush_ms)
    return Publisher(settings, client, tokenizer, "w1")


def test_tokens_wait_in_runs_but_first_tokens_and_ends_go_at_once(redis_settings, client, tokenizer, keys, ids):
    """With a flush interval, a request's tokens of several steps are one entry; its first token
    (the time to first token) and its last (the end) are written when they come."""
    publisher = flushing(redis_settings, client, tokenizer, 60_000)
    publish(publisher, [started(), *tokens(ids, 0, 1)], flush=False)
    assert publisher.flush() == [] and entries(client, keys) == [[ids[0]]]  # the first token: urgent
    for i in range(1, 5):  # four steps
        publish(publisher, tokens(ids, i, i + 1), flush=False)
        assert publisher.flush() == [] and len(entries(client, keys)) == 1  # not due: they wait
    assert RequestMeta.from_hash(client.hgetall(keys.meta(RID))).status is RequestStatus.RUNNING
    publish(publisher, tokens(ids, 5, 7, last_reason="length"), flush=False)
    publisher.flush()  # the end is urgent: the waiting run goes with it
    assert entries(client, keys) == [ids[:1], ids[1:7]]
    out = chunks(client, keys)
    assert [c.index for c in out] == list(range(7)) and "".join(c.text for c in out) == tokenizer.decode(ids[:7])
    assert out[-1].finished and out[-1].finish_reason == "length" and not any(c.finished for c in out[:-1])
    assert RequestMeta.from_hash(client.hgetall(keys.meta(RID))).status is RequestStatus.FINISHED


def test_runs_are_due_at_the_interval(redis_settings, client, tokenizer, keys, ids):
    publisher = flushing(redis_settings, client, tokenizer, 50)
    publish(publisher, [started(), *tokens(ids, 0, 3)], flush=False)
    publisher.flush()  # the first token made it urgent: all three go
    publish(publisher, tokens(ids, 3, 5), flush=False)
    assert publisher.flush() == [] and len(entries(client, keys)) == 1
    wait_s = publisher.wait_s()
    assert wait_s is not None and 0 < wait_s <= 0.05
    time.sleep(wait_s)
    publisher.flush()
    assert entries(client, keys) == [ids[:3], ids[3:5]]


def test_a_request_whose_epoch_moved_on_gets_nothing_written(publisher, client, keys, ids):
    """The pool gave the request to another worker (a new epoch): this publisher's writes are refused
    atomically, its samples go back to the serve loop to free, and its later events are dropped;
    its inbox entry is still acknowledged."""
    ensure_group(client, keys.inbox("w1"), WORKER_GROUP)
    inbox_id = client.xadd(keys.inbox("w1"), {"msg": "x"})
    client.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"})
    client.hset(keys.meta(RID), mapping={"status": "running", "epoch": 1})
    assert publish(publisher, [Started(started().msg, epoch=1), *tokens(ids, 0, 2)]) == []
    # A reap of w1 took it, as the janitor does: the request's fence (status hash, then data fence).
    assert fence(client, keys, RID) == 2
    client.hset(keys.meta(RID), "status", "queued")
    assert publish(publisher, tokens(ids, 2, 4)) == [(RID, 0)]
    assert publish(publisher, [*tokens(ids, 4, 6, last_reason="length"), Released(RID, inbox_id)]) == []
    assert [c.index for c in chunks(client, keys)] == [0, 1]
    assert client.hget(keys.meta(RID), "status") == "queued"  # never finished by the stale writer
    assert client.lrange(keys.output_lengths(), 0, -1) == [] and client.xlen(keys.inbox("w1")) == 0
    assert publisher.requests == {} and publisher.texts.outputs == {} and publisher.fenced_out == set()


def test_runs_are_published_to_listeners_only(publisher, client, keys, ids):
    """A request's runs are published while someone subscribes to its channel (from the first run
    after the subscription on), not otherwise; a pattern subscriber hears every request's runs."""
    other = "o" * 32
    quiet = Started(GenerateRequest(id=other, prompt_ids=[1], created_ms=0, params=SamplingParams(max_new_tokens=8)))
    publish(publisher, [started(), quiet, *tokens(ids, 0, 1), Token(other, 0, ids[0], -0.5, None)])
    heard = client.pubsub()
    heard.subscribe(keys.channel(RID))
    heard.get_message(timeout=1)  # the subscribe confirmation
    publish(publisher, [*tokens(ids, 1, 3), Token(other, 1, ids[1], -0.5, None)])
    publish(publisher, [*tokens(ids, 3, 4), Token(other, 2, ids[2], -0.5, None)])
    runs = [parse_run({"msg": m["data"]}) for m in iter(lambda: heard.get_message(timeout=1), None)]
    assert [r.token_ids for r in runs] == [ids[1:3], ids[3:4]]  # every run since it subscribed
    listens = client.pubsub()
    listens.psubscribe(keys.channels())
    listens.get_message(timeout=1)
    publish(publisher, [Token(other, 3, ids[3], -0.5, None)])  # nobody on its channel, but a pattern
    message = listens.get_message(timeout=1)
    assert message is not None and parse_run({"msg": message["data"]}).token_ids == [ids[3]]
    listens.close()
    heard.close()
    client.delete(keys.chunks(other), keys.meta(other))


def test_nothing_is_published_where_nobody_listens(tokenizer, ids):
    """Counted on a Redis of its own (commandstats counts every client's commands)."""
    server = start_embedded_redis()
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        settings = WorkerSettings(redis=RedisSettings(url=server.url))
        alone = Publisher(settings, client, tokenizer, "w1")
        publish(alone, [started(), *tokens(ids, 0, 3)])
        publish(alone, tokens(ids, 3, 5, last_reason="length"))
        stats = client.info("commandstats")
        assert "cmdstat_publish" not in stats and stats["cmdstat_xadd"]["calls"] == 2  # two runs
    finally:
        client.close()
        server.stop()


def test_a_paused_request_goes_back_after_its_tokens_with_a_new_epoch(publisher, client, keys, ids):
    from worker.engine.events import Preempted

    ensure_group(client, keys.inbox("w1"), WORKER_GROUP)
    inbox_id = client.xadd(keys.inbox("w1"), {"msg": "x"})
    client.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"})
    client.hset(keys.meta(RID), mapping={"status": "running", "epoch": 3, "worker": "w1"})
    msg = started().msg
    publish(publisher, [Started(msg, epoch=3), *tokens(ids, 0, 3)])
    back = msg.model_copy(update={"resume_ids": ids[:4], "preemptions": 1})
    publish(publisher, [*tokens(ids, 3, 4), Preempted(RID, inbox_id, back)])
    assert [c.token_id for c in chunks(client, keys)] == ids[:4]
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.QUEUED and meta.epoch == 4 and meta.worker is None
    ((_, fields),) = client.xrange(keys.requests())
    assert GenerateRequest.model_validate_json(fields["msg"]).resume_ids == ids[:4]
    assert client.xlen(keys.inbox("w1")) == 0


def test_runs_are_fenced_by_the_data_fence_and_the_rest_by_the_status_hash(publisher, client, keys, ids):
    """A fence's two steps (``shared.request_log.fence``): the status hash's epoch refuses starts,
    ends and fences, the data fence (raised second) refuses runs. Between the two a run is still
    written (the fence reads the chunks as final only after its second step) and an end is not."""
    other = "o" * 32
    msg = GenerateRequest(id=other, prompt_ids=[1], created_ms=0, params=SamplingParams(max_new_tokens=8))
    for rid in (RID, other):
        client.hset(keys.meta(rid), mapping={"status": "running", "epoch": 1})
    publish(publisher, [Started(started().msg, epoch=1), Started(msg, epoch=1), *tokens(ids, 0, 1)])
    client.hincrby(keys.meta(RID), "epoch", 1)  # a fence's first step alone
    assert publish(publisher, tokens(ids, 1, 2)) == []  # a run: written
    assert publish(publisher, tokens(ids, 2, 3, last_reason="length")) == [(RID, 0)]  # its end: refused
    assert [c.index for c in chunks(client, keys)] == [0, 1, 2] and client.hget(keys.meta(RID), "status") == "running"
    assert fence(client, keys, other) == 2  # both steps
    assert publish(publisher, [Token(other, 0, ids[0], -0.5, None)]) == [(other, 0)]
    assert chunks(client, keys, other) == [] and client.get(keys.data_fence(other)) == "2"
    client.delete(keys.meta(other), keys.data_fence(other))


def test_a_fenced_request_is_refused_beside_others_of_its_flush(publisher, client, keys, ids):
    """One flush writes several requests of several groups (one data script on one server, one a
    group on a cluster): the fenced one's run is refused, its neighbours' written, in their places."""
    from shared.keys import group

    rids = [c * 32 for c in "abcdefgh"]
    rids = [rids[0], next(r for r in rids if group(r) != group(rids[0])), "z" * 32]
    msgs = [GenerateRequest(id=r, prompt_ids=[1], created_ms=0, params=SamplingParams(max_new_tokens=8)) for r in rids]
    for rid in rids:
        client.hset(keys.meta(rid), mapping={"status": "running", "epoch": 1})
    assert publish(publisher, [Started(m, epoch=1) for m in msgs]) == []
    assert fence(client, keys, rids[1]) == 2
    written = [Token(rid, 0, ids[0], -0.5, None) for rid in rids]
    assert publish(publisher, written) == [(rids[1], 0)]
    assert [len(chunks(client, keys, rid)) for rid in rids] == [1, 0, 1]
    client.delete(*(key for rid in rids for key in (keys.meta(rid), keys.chunks(rid), keys.data_fence(rid))))
