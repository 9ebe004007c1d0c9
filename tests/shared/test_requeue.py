"""shared.requeue for groups against a real Redis: a group goes back with each
choice's emitted tokens and its finished choices; one that has ended (every
choice finished, or a tokenless end) or was cancelled is not requeued."""

from __future__ import annotations

import pytest

from lightq.dead_letters import requeue_dead
from shared.chunk_schemas import TokenChunk
from shared.chunks import emitted_chunks, has_ended
from shared.codec import entry, from_entry
from shared.requeue import Death, hand_back_inbox, requeue
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.chunks import append_chunk

RID = "g"
DIED = Death(blamed=frozenset({RID}), witnesses=frozenset({RID}))  # its worker died, blamed on it


def group(n=3) -> GenerateRequest:
    return GenerateRequest(
        id=RID, prompt_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=8), created_ms=0, n=n, attempt=1
    )


def write(rclient, keys, *chunks: tuple[int, int, int | None, str | None]) -> None:
    """(choice, index, token id, finish reason) chunks, after a running status."""
    rclient.hset(keys.meta(RID), mapping=RequestMeta.fields(status=RequestStatus.RUNNING))
    pipe = rclient.pipeline()
    for choice, index, token_id, reason in chunks:
        append_chunk(
            pipe,
            keys,
            TokenChunk(
                request_id=RID,
                index=index,
                choice=choice,
                token_id=token_id,
                finished=reason is not None,
                finish_reason=reason,
            ),
        )
    pipe.execute()


def meta(rclient, keys) -> RequestMeta:
    return RequestMeta.from_hash(rclient.hgetall(keys.meta(RID)))


def test_a_group_goes_back_with_each_choices_tokens_and_its_finished_choices(rclient, keys):
    # choice 0: 3 tokens (one chunk written twice, out of order); 1: finished after 2; 2: nothing yet
    write(
        rclient,
        keys,
        (0, 0, 10, None),
        (1, 0, 20, None),
        (0, 1, 11, None),
        (1, 1, 21, "stop"),
        (0, 1, 11, None),
        (0, 2, 12, None),
    )
    chunks = emitted_chunks(rclient, keys, RID)
    assert not has_ended(chunks, 3)
    assert requeue(rclient, keys, group(), ttl_s=60, max_attempts=5, death=DIED) == 1
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert again.group_resume == [[10, 11, 12], [20, 21], []] and again.finished_choices == [1]
    assert again.resume_ids == [] and again.attempt == 2
    assert again.open_choices == [0, 2] and again.num_emitted == 5
    assert meta(rclient, keys).status is RequestStatus.QUEUED


def test_a_group_whose_every_choice_finished_ends_instead(rclient, keys):
    write(rclient, keys, (0, 0, 10, "length"), (1, 0, 20, None), (1, 1, 21, "stop"), (2, 0, 30, "stop"))
    assert has_ended(emitted_chunks(rclient, keys, RID), 3)
    assert requeue(rclient, keys, group(), ttl_s=60, max_attempts=5) == 0
    assert rclient.xlen(keys.requests()) == 0
    ended = meta(rclient, keys)
    assert ended.status is RequestStatus.FINISHED and ended.output_tokens == 4


@pytest.mark.parametrize("tokenless", [True, False])
def test_a_cancelled_or_tokenless_ended_group_is_not_requeued(rclient, keys, tokenless):
    write(rclient, keys, (0, 0, 10, None), (1, 0, 20, "stop"))
    if tokenless:  # e.g. the worker's end of a cancelled sample: it ends every choice
        write(rclient, keys, (2, 0, None, "cancelled"))
    else:  # the client cancelled; nothing ended it yet
        rclient.set(keys.cancel(RID), 1)
    assert has_ended(emitted_chunks(rclient, keys, RID), 3) is tokenless
    assert requeue(rclient, keys, group(), ttl_s=60, max_attempts=5) == 0
    assert rclient.xlen(keys.requests()) == 0
    ended = meta(rclient, keys)
    assert ended.status is (RequestStatus.FINISHED if tokenless else RequestStatus.CANCELLED)
    assert ended.output_tokens == 2


def test_a_dead_lettered_group_requeued_by_the_cli_resumes_too(rclient, keys):
    write(rclient, keys, (0, 0, 10, None), (1, 0, 20, "stop"), (2, 0, 30, None), (2, 1, 31, None))
    assert requeue(rclient, keys, group(), ttl_s=60, max_attempts=2, death=DIED) == 0
    assert meta(rclient, keys).status is RequestStatus.FAILED and rclient.xlen(keys.dead_letters()) == 1
    assert requeue_dead(rclient, keys, [], ttl_s=60) == 1
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert again.resume_ids == [] and again.group_resume == [[10], [20], [30, 31]]
    assert again.finished_choices == [1] and again.attempt == 0


def test_a_handed_back_group_keeps_its_attempt_count(rclient, keys):
    write(rclient, keys, (0, 0, 10, None))
    rclient.xadd(keys.inbox("w1"), entry(group()))
    assert hand_back_inbox(rclient, keys, "w1", ttl_s=60, max_attempts=2) == 1
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert again.attempt == 1 and again.group_resume == [[10], [], []] and again.finished_choices == []
    assert rclient.xlen(keys.inbox("w1")) == 0


def test_a_single_request_still_goes_back_with_resume_ids(rclient, keys):
    write(rclient, keys, (0, 0, 10, None), (0, 1, 11, None))
    single = group(n=1)
    assert requeue(rclient, keys, single, ttl_s=60, max_attempts=5) == 1
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert again.resume_ids == [10, 11] and again.group_resume == [] and again.finished_choices == []


def test_a_death_counts_against_the_blamed_and_running_through_too_many_dead_letters_too(rclient, keys):
    """Blamed: its attempt counts the death. Only witnessed (it ran there too): its ``deaths`` do,
    and past DEATHS_PER_ATTEMPT x max_attempts of them it is dead-lettered all the same."""
    write(rclient, keys, (0, 0, 10, None))
    single = group(n=1).model_copy(update={"attempt": 0})
    witnessed = Death(witnesses=frozenset({RID}))
    assert requeue(rclient, keys, single, ttl_s=60, max_attempts=2, death=witnessed) == 1
    again = from_entry(GenerateRequest, rclient.xrange(keys.requests())[-1][1])
    assert (again.attempt, again.deaths) == (0, 1)
    rclient.hset(keys.meta(RID), "status", "running")
    assert (
        requeue(rclient, keys, again.model_copy(update={"deaths": 3}), ttl_s=60, max_attempts=2, death=witnessed) == 0
    )
    assert meta(rclient, keys).status is RequestStatus.FAILED and "4 workers died" in meta(rclient, keys).error
