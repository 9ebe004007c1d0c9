"""The publisher's text against a real Redis: stop strings on the text, held
text, requests a stop ended while the engine still ran them, resumed requests,
a group's samples (its writes: test_publisher_writes.py). The fixtures and
helpers here are its sibling files' too."""

from __future__ import annotations

import pytest

from shared.chunk_schemas import TokenChunk
from shared.chunks import parse_run
from shared.config import ModelSettings
from shared.keys import WORKER_GROUP
from shared.redis import ensure_group, sync_client
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.worker.token_rows import pack, rows
from worker.engine.events import Ended, Event, Released, Started, Token, Tokens
from worker.service.publisher import Publisher, Sample

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
