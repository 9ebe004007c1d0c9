"""The publisher against a real Redis: stop strings on the text, held text,
requests a stop ended while the engine still ran them, resumed requests; runs
of tokens and when they are written, writes refused by the epoch, publishing
to listeners only, a paused request's way back; and the publisher process
behind its pipes."""

from __future__ import annotations

import time
from multiprocessing.connection import wait

import pytest
import redis

from shared.chunk_schemas import TokenChunk
from shared.chunks import parse_run
from shared.config import ModelSettings, RedisSettings
from shared.embedded_redis import start_embedded_redis
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group, sync_client
from shared.request_log import fence
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.waiting import MUST_HAPPEN_S
from tests.worker.token_rows import pack, rows
from worker.engine.events import Ended, Event, Released, Started, Token, Tokens
from worker.service.publisher import Publisher, Sample
from worker.service.publisher_process import PublisherDied, PublisherLink, owner

TEXT = " The answer is 42. Done here."
RID = "r" * 32


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer  # loaded once a session (tests/conftest.py)


@pytest.fixture
def client(redis_settings):
    client = sync_client(redis_settings)
    yield client
    client.close()


@pytest.fixture
def publisher(redis_settings, client, tokenizer):
    return Publisher(WorkerSettings(redis=redis_settings), client, tokenizer, "w1")


@pytest.fixture
def ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(TEXT)
    assert [tokenizer.decode([i]) for i in ids][3:7] == [" ", "4", "2", "."]  # "42." spans three tokens
    return ids


def tokenizer_only(folder: str) -> ModelSettings:
    """The publisher processes' model: SmolLM2's tokenizer as a directory (tests/conftest.py), the
    same tokenizer as ``default``'s in a fraction of the time each process takes to load it."""
    return ModelSettings(model_dir=folder)


def publish(publisher: Publisher, events: list, steps: int = 1, flush: bool = True) -> list[Sample]:
    """Record ``events`` (``Token`` rows packed into ``Tokens`` records, as the engine sends them),
    split into ``steps`` consecutive steps, then write everything (``flush``); the samples a stop
    string ended, and those of refused requests."""
    packed: list[Event] = []
    for event in events:
        if isinstance(event, Token):
            if packed and isinstance(packed[-1], Tokens):
                packed[-1] = pack([*rows(packed[-1]), event])
            else:
                packed.append(pack([event]))
        else:
            packed.append(event)
    size = -(-len(packed) // steps)
    stopped = publisher.record([(0, packed[i : i + size]) for i in range(0, len(packed), size)])
    return stopped + (publisher.flush(everything=True) if flush else [])


def chunks(client, keys, request_id=RID) -> list[TokenChunk]:
    """Every token of the stream, as readers see them."""
    return [c for _, fields in client.xrange(keys.chunks(request_id)) for c in parse_run(fields).tokens()]


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


def tokens(ids, start=0, stop=None, last_reason=None) -> list[Token]:
    stop = len(ids) if stop is None else stop
    return [Token(RID, i, ids[i], -0.5, last_reason if i == stop - 1 else None) for i in range(start, stop)]


def started(stops=(), resume_ids=(), min_new_tokens=0, n=1) -> Started:
    return Started(
        GenerateRequest(
            id=RID,
            prompt_ids=[1, 2, 3],
            resume_ids=list(resume_ids),
            n=n,
            created_ms=0,
            params=SamplingParams(max_new_tokens=16, stop_sequences=tuple(stops), min_new_tokens=min_new_tokens),
        )
    )


def test_a_stop_split_across_tokens_ends_the_request(publisher, client, keys, ids):
    ensure_group(client, keys.inbox("w1"), WORKER_GROUP)
    inbox_id = client.xadd(keys.inbox("w1"), {"msg": "x"})
    client.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"})
    publish(publisher, [started(["42."]), *tokens(ids, 0, 5)])
    assert "".join(c.text for c in chunks(client, keys)) == " The answer is "  # "4" is held back
    assert publish(publisher, tokens(ids, 5, 7)) == [(RID, 0)]  # "2", "." complete the stop string
    # The engine runs the request a step or two more, then frees it (as a cancel).
    publish(
        publisher, [*tokens(ids, 7, 9), Ended(RID, RequestStatus.CANCELLED, "cancelled", 9), Released(RID, inbox_id)]
    )
    out = chunks(client, keys)
    assert [c.index for c in out] == list(range(7))
    assert "".join(c.text for c in out) == " The answer is "
    assert out[-1].finished and out[-1].finish_reason == "stop" and out[-1].token_id == ids[6]
    assert not any(c.finished for c in out[:-1])
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.FINISHED and meta.finish_reason == "stop" and meta.output_tokens == 7
    assert client.lrange(keys.output_lengths(), 0, -1) == ["7"]
    assert client.xlen(keys.inbox("w1")) == 0 and client.xpending(keys.inbox("w1"), WORKER_GROUP)["pending"] == 0
    assert publisher.ended_by_stop == set() and publisher.texts.outputs == {}


def test_held_text_is_released_when_the_output_ends_otherwise(publisher, client, keys, ids):
    assert publish(publisher, [started(["Done!", "42!"]), *tokens(ids, last_reason="length")]) == []
    out = chunks(client, keys)
    assert "".join(c.text for c in out) == TEXT
    assert [c.text for c in out[4:7]] == ["", "", "42."]  # held while it could become "42!"
    assert out[-1].finish_reason == "length"


def test_a_stop_on_the_engines_last_token_needs_no_freeing(publisher, client, keys, ids):
    assert publish(publisher, [started(["."]), *tokens(ids, 0, 7, last_reason="length"), Released(RID, "1-0")]) == []
    out = chunks(client, keys)
    assert out[-1].finish_reason == "stop" and "".join(c.text for c in out) == " The answer is 42"
    assert publisher.ended_by_stop == set()


def test_stops_wait_for_min_new_tokens(publisher, client, keys, ids):
    publish(publisher, [started([" The", "."], min_new_tokens=2), *tokens(ids, 0, 8)])
    out = chunks(client, keys)
    assert out[0].text == " The" and len(out) == 7 and out[-1].finish_reason == "stop"


def test_a_resumed_request_gets_back_its_held_text(publisher, client, keys, ids):
    # An earlier attempt emitted tokens 0-4 and held "4" (it could start "4x").
    publish(publisher, [started(["4x"], resume_ids=ids[:5]), *tokens(ids, 5, 7)])
    assert [c.text for c in chunks(client, keys)] == ["42", "."]


def test_a_resumed_request_cut_inside_a_character_gets_the_character(publisher, client, keys):
    """A migration or pause between the bytes of one character (a byte-level tokenizer's CJK and
    emoji): the bytes the earlier attempt held back are not lost (red team 7: '日本語' came back '日本')."""
    from worker.service.detokenizer import IncrementalDecoder

    tokenizer = publisher.texts.tokenizer
    ids = tokenizer.encode(" 日本語と😀 ok", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # the text has cuts inside characters
    first = IncrementalDecoder(tokenizer, [1, 2, 3])
    head = "".join(first.push(i) for i in ids[: cuts[0]])  # what the first attempt emitted
    publish(publisher, [started(resume_ids=ids[: cuts[0]]), *tokens(ids, cuts[0], len(ids), last_reason="length")])
    assert head + "".join(c.text for c in chunks(client, keys)) == " 日本語と😀 ok"


def test_steps_written_together_keep_their_order_and_stops(publisher, client, keys, ids):
    """Several steps in one write (the publisher fell behind): chunks in order, each index once."""
    stopped = publish(publisher, [started(["answer"]), *tokens(ids, 0, 4)], steps=5)
    assert stopped == [(RID, 0)]
    assert [c.index for c in chunks(client, keys)] == [0, 1]


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


def test_a_groups_samples_have_their_own_text_stops_and_one_end(publisher, client, keys, ids):
    """Choice 1 stops on "42." while choices 0 and 2 run to their lengths; the status
    says finished once, after the last sample, with every sample's tokens counted."""

    def sample(choice, start, stop, last_reason=None):
        return [Token(RID, i, ids[i], -0.5, last_reason if i == stop - 1 else None, choice) for i in range(start, stop)]

    assert publish(
        publisher, [started(("42.",), n=3), *sample(0, 0, 2), *sample(1, 0, 7), *sample(2, 0, 3, "length")]
    ) == [(RID, 1)]
    assert RequestMeta.from_hash(client.hgetall(keys.meta(RID))).status is RequestStatus.RUNNING
    publish(publisher, [*sample(1, 7, 8), *sample(0, 2, 5, "length"), Released(RID, "1-0")])  # 1's extra: dropped
    out = chunks(client, keys)
    text = {c: "".join(x.text for x in out if x.choice == c) for c in range(3)}
    assert text == {0: " The answer is 4", 1: " The answer is ", 2: " The answer is"}
    assert [(x.choice, x.finish_reason) for x in out if x.finished] == [(1, "stop"), (2, "length"), (0, "length")]
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.FINISHED and meta.output_tokens == 5 + 7 + 3
    assert sorted(client.lrange(keys.output_lengths(), 0, -1)) == ["3", "5", "7"]
    assert publisher.texts.outputs == {} and publisher.requests == {} and publisher.ended_by_stop == set()


def test_a_requeued_group_resumes_each_samples_text_and_counts_its_finished_ones(publisher, client, keys, ids):
    """Choice 1 finished in an earlier attempt (3 tokens); choice 0 emitted 5 with "4" held back
    (it could start "4x"), choice 2 emitted 2. Only 0 and 2 run here; the status ends once, after
    both, with every sample's tokens counted (3 + 7 + 4)."""
    msg = GenerateRequest(
        id=RID,
        prompt_ids=[1, 2, 3],
        params=SamplingParams(max_new_tokens=8, stop_sequences=("4x",)),
        created_ms=0,
        n=3,
        group_resume=[ids[:5], ids[:3], ids[:2]],
        finished_choices=[1],
    )
    event = Started(msg)
    assert msg.open_choices == [0, 2] and msg.emitted(2) == ids[:2]
    publish(publisher, [event, Token(RID, 5, ids[5], -0.5, None, 0), Token(RID, 2, ids[2], -0.5, None, 2)])
    assert sorted(publisher.texts.outputs) == [(RID, 0), (RID, 2)]
    assert [(c.choice, c.index, c.text) for c in chunks(client, keys)] == [(0, 5, "42"), (2, 2, " is")]
    publish(publisher, [Token(RID, 6, ids[6], -0.5, "length", 0)])
    assert RequestMeta.from_hash(client.hgetall(keys.meta(RID))).status is RequestStatus.RUNNING
    publish(publisher, [Token(RID, 3, ids[3], -0.5, "length", 2)])
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.FINISHED and meta.output_tokens == 3 + 7 + 4
    assert publisher.texts.outputs == {}


@pytest.mark.timeout(180)  # without the bound it would retry forever
def test_an_orphaned_publisher_stops_retrying_a_dead_redis(redis_settings, tokenizer, monkeypatch):
    """Once its worker is gone, a write that cannot reach Redis is given up after ORPHAN_RETRY_S
    (its requests resume elsewhere), instead of retrying forever as an orphan."""
    import redis as redis_lib
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from worker.service import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "ORPHAN_RETRY_S", 0.2)
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
