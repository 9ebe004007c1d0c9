"""A paused group's way back through the publisher (issue 33 item 7, real Redis): a stop string ends a
sample here before the engine hears of it, and the engine runs it on; the group goes back with that
sample finished at its last written token, not with the engine's longer output. A group whose every
sample ended that way has ended: nothing goes back."""

from __future__ import annotations

import pytest

from shared.keys import WORKER_GROUP
from shared.redis import ensure_group
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.worker.test_publisher import RID, chunks, client, ids, publish, publisher, tokenizer  # noqa: F401
from worker.engine.events import Preempted, Started, Token


def group(n: int) -> GenerateRequest:
    params = SamplingParams(max_new_tokens=16, stop_sequences=(" is",))
    return GenerateRequest(id=RID, prompt_ids=[1, 2, 3], params=params, created_ms=0, n=n)


def running(client, keys) -> str:
    """A request dispatched to w1 (its inbox entry, read), running at epoch 3."""
    ensure_group(client, keys.inbox("w1"), WORKER_GROUP)
    inbox_id = client.xadd(keys.inbox("w1"), {"msg": "x"})
    client.xreadgroup(WORKER_GROUP, "w1", {keys.inbox("w1"): ">"})
    client.hset(keys.meta(RID), mapping={"status": "running", "epoch": 3, "worker": "w1"})
    return inbox_id


def sample(ids, choice: int, start: int, stop: int) -> list[Token]:
    return [Token(RID, i, ids[i], -0.5, None, choice) for i in range(start, stop)]


@pytest.mark.parametrize("stopped", [0, 1])
def test_a_sample_a_stop_string_ended_goes_back_finished_at_its_written_end(publisher, client, keys, ids, stopped):
    inbox_id = running(client, keys)
    msg, other = group(2), 1 - stopped
    # One sample reaches " is" (index 2, the stop) and the engine runs it one token on; the other does not.
    publish(publisher, [Started(msg, epoch=3), *sample(ids, other, 0, 2), *sample(ids, stopped, 0, 4)])
    engine_view = [ids[:4], ids[:4]]
    engine_view[other] = ids[:2]
    publish(publisher, [Preempted(RID, inbox_id, msg.model_copy(update={"group_resume": engine_view}))])
    assert sorted((c.choice, c.index) for c in chunks(client, keys)) == sorted(
        [(other, 0), (other, 1), (stopped, 0), (stopped, 1), (stopped, 2)]
    )
    ((_, fields),) = client.xrange(keys.requests())
    back = GenerateRequest.model_validate_json(fields["msg"])
    expected = [ids[:3], ids[:3]]
    expected[other] = ids[:2]
    assert (back.group_resume, back.finished_choices) == (expected, [stopped])
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.QUEUED and meta.epoch == 4 and client.xlen(keys.inbox("w1")) == 0


def test_a_group_whose_every_sample_ended_is_not_sent_back(publisher, client, keys, ids):
    inbox_id = running(client, keys)
    msg = group(2)
    publish(publisher, [Started(msg, epoch=3), *sample(ids, 0, 0, 3), *sample(ids, 1, 0, 4)])
    engine_view = msg.model_copy(update={"group_resume": [ids[:3], ids[:4]], "preemptions": 1})
    publish(publisher, [Preempted(RID, inbox_id, engine_view)])
    assert client.xlen(keys.requests()) == 0 and client.xlen(keys.inbox("w1")) == 0
    meta = RequestMeta.from_hash(client.hgetall(keys.meta(RID)))
    assert meta.status is RequestStatus.FINISHED and meta.output_tokens == 6
