"""The publisher against a real Redis: stop strings on the text, held text,
requests a stop ended while the engine still ran them, resumed requests; and
the publisher process behind its pipes."""

from __future__ import annotations

import time

import pytest

from shared import codec
from shared.config import ModelSettings, WorkerSettings
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group, sync_client
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams, TokenChunk
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


def publish(publisher: Publisher, events: list, steps: int = 1) -> list[Sample]:
    """Write ``events`` (``Token`` rows packed into ``Tokens`` records, as the engine sends them),
    split into ``steps`` consecutive steps of one write; the samples a stop string ended."""
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
    return publisher.publish([(0, packed[i : i + size]) for i in range(0, len(packed), size)])


def chunks(client, keys, request_id=RID) -> list[TokenChunk]:
    return [codec.from_entry(TokenChunk, fields) for _, fields in client.xrange(keys.chunks(request_id))]


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
    assert publisher.ended_by_stop == set() and publisher.outputs == {}


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
    deadline = time.monotonic() + 60
    stopped: list = []
    while not stopped and time.monotonic() < deadline:
        stopped = link.take_stopped()
        time.sleep(0.05)
    link.close()
    assert stopped == [(RID, 0)]
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
    assert publisher.outputs == {} and publisher.groups == {} and publisher.ended_by_stop == set()


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
    assert sorted(publisher.outputs) == [(RID, 0), (RID, 2)]
    assert [(c.choice, c.index, c.text) for c in chunks(client, keys)] == [(0, 5, "42"), (2, 2, " is")]
    publish(publisher, [Token(RID, 6, ids[6], -0.5, "length", 0)])
    assert RequestMeta.from_hash(client.hgetall(keys.meta(RID))).status is RequestStatus.RUNNING
    publish(publisher, [Token(RID, 3, ids[3], -0.5, "length", 2)])
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.FINISHED and meta.output_tokens == 3 + 7 + 4
    assert publisher.outputs == {}


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
