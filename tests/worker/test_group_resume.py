"""A requeued group resumes each sample exactly, on a tiny random Llama and a real
Redis: a first worker runs the group some steps and dies; its chunks go through
the real ``shared.requeue.requeue``; a fresh engine runs the requeued message.
Each choice's tokens must continue the ones the client already has (no index
twice), the prompt is prefilled once plus each open sample's own tokens, and a
choice that had finished is not run again."""

from __future__ import annotations

import pytest

from shared import ingress
from shared.admission import request_states as router_states
from shared.chunk_schemas import TokenChunk
from shared.codec import from_entry
from shared.peak import ReqState
from shared.requeue import Death, requeue
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from tests.chunks import append_chunk
from tests.worker.test_engine import POOL, make_engine, tiny  # noqa: F401 (fixture)
from tests.worker.test_engine_groups import count_prefill_tokens, run
from tests.worker.token_rows import flat
from worker.engine.events import Ended, Released, Started, Token
from worker.engine.load import request_states
from worker.engine.request import Req

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
MAX_NEW = 14
SEEDED = dict(do_sample=True, temperature=1.5, seed=1234)


def group_msg(**params) -> GenerateRequest:
    return GenerateRequest(
        id="g", prompt_ids=PROMPT, params=SamplingParams(max_new_tokens=MAX_NEW, **params), created_ms=0, n=3
    )


def first_attempt(folder, msg: GenerateRequest, steps: int, stop: dict[int, int]) -> list[Token]:
    """Run ``msg`` for ``steps`` steps on a worker that then dies; ``stop[choice] = step``: a stop
    string ends that sample after that step (the engine is told, as the serve loop does)."""
    engine = make_engine(folder)
    engine.add(Req(msg=msg, inbox_id="1-0"))
    tokens: list[Token] = []
    for step in range(steps):
        tokens += [e for e in flat(engine.step()) if isinstance(e, Token)]
        for choice in [c for c, at in stop.items() if at == step]:
            engine.stop(next(r for r in engine.running if r.choice == choice))
    return tokens


def requeued(
    rclient, keys, msg: GenerateRequest, tokens: list[Token], stopped: set[int], lost: set[tuple[int, int]]
) -> GenerateRequest:
    """Write the first attempt's chunks as its publisher would (a stopped sample's last chunk finished,
    ``lost`` (choice, index) never written, one chunk written twice), requeue, read the message back."""
    last = {t.choice: t.index for t in tokens}
    rclient.hset(keys.meta(msg.id), mapping=RequestMeta.fields(status=RequestStatus.RUNNING))
    pipe = rclient.pipeline()
    for t in [*tokens, tokens[0]]:  # a retried pipeline may repeat a chunk
        if (t.choice, t.index) in lost:
            continue
        stop = t.choice in stopped and t.index == last[t.choice]
        reason = "stop" if stop else t.finish_reason
        append_chunk(
            pipe,
            keys,
            TokenChunk(
                request_id=msg.id,
                index=t.index,
                choice=t.choice,
                token_id=t.token_id,
                finished=reason is not None,
                finish_reason=reason,
            ),
        )
    pipe.execute()
    died = Death(blamed=frozenset({msg.id}))  # its worker died, blamed on it
    assert requeue(rclient, keys, msg, ttl_s=60, max_attempts=3, death=died) == 1
    return from_entry(GenerateRequest, ingress.entries(rclient, keys)[-1][1])


def own_tokens(tokens: list[Token], choice: int, lost=frozenset()) -> list[int]:
    return [
        t.token_id
        for t in sorted(tokens, key=lambda t: t.index)
        if t.choice == choice and (choice, t.index) not in lost
    ]


def resume_and_check(folder, again: GenerateRequest) -> tuple[dict[int, list[int]], list]:
    """Run the requeued message on a fresh engine; each choice's whole output (emitted + new), checking
    that new indexes follow the emitted ones, the prefill count and the single Started/Released."""
    engine = make_engine(folder)
    fed = count_prefill_tokens(engine)
    new, events = run(engine, Req(msg=again, inbox_id="2-0"))
    assert sum(fed) == len(PROMPT) + sum(len(again.emitted(c)) for c in again.open_choices)
    assert [type(e) for e in events].count(Started) == 1 and [type(e) for e in events].count(Released) == 1
    assert isinstance(events[-1], Released)
    assert engine.runner.pool.num_free == POOL and engine.runner.table.num_free_rows == 8
    full: dict[int, list[int]] = {}
    for c in range(again.n):
        indexes = [e.index for e in events if isinstance(e, Token) and e.choice == c]
        emitted = again.emitted(c)
        assert indexes == list(range(len(emitted), len(emitted) + len(indexes))), c  # none twice, no gap
        full[c] = emitted + new.get(("g", c), [])
    return full, events


@pytest.mark.parametrize(
    "params",
    [{}, dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)],
    ids=["greedy", "penalties"],
)
@pytest.mark.parametrize("finished", [None, 0, 1])
def test_requeued_greedy_group_resumes_each_sample_exactly(tiny, rclient, keys, params, finished):
    _, folder = tiny
    msg = group_msg(**params)
    whole, _ = run(make_engine(folder), Req(msg=msg, inbox_id="0-0"))
    assert all(len(whole[("g", c)]) == MAX_NEW for c in range(3))
    stop = {finished: 2} if finished is not None else {}
    tokens = first_attempt(folder, msg, steps=6, stop=stop)
    lost = {(2, 5), (2, 4)}  # choice 2's last two chunks never reached Redis: it resumes 2 tokens earlier
    again = requeued(rclient, keys, msg, tokens, set(stop), lost)
    assert again.attempt == 1 and again.resume_ids == []
    assert again.finished_choices == ([finished] if finished is not None else [])
    assert [again.emitted(c) for c in range(3)] == [own_tokens(tokens, c, lost) for c in range(3)]
    assert [len(again.emitted(c)) for c in range(3)] == [3 if c == finished else 6 if c < 2 else 4 for c in range(3)]
    full, events = resume_and_check(folder, again)
    for c in range(3):
        if c == finished:
            assert not [e for e in events if isinstance(e, Token) and e.choice == c]  # not run again
            assert full[c] == whole[("g", c)][:3]
        else:
            assert full[c] == whole[("g", c)], c


def test_requeued_seeded_group_continues_each_samples_own_random_stream(tiny, rclient, keys):
    """Choice 0 (whose seed is the request's) finished: the leader is choice 1, with its derived seed."""
    _, folder = tiny
    msg = group_msg(**SEEDED)
    whole, _ = run(make_engine(folder), Req(msg=msg, inbox_id="0-0"))
    assert len({tuple(whole[("g", c)]) for c in range(3)}) == 3
    tokens = first_attempt(folder, msg, steps=5, stop={0: 1})
    again = requeued(rclient, keys, msg, tokens, {0}, lost={(1, 4)})
    full, _ = resume_and_check(folder, again)
    assert full == {0: whole[("g", 0)][:2], 1: whole[("g", 1)], 2: whole[("g", 2)]}


def test_a_poisoned_seed_changes_only_the_tokens_after_the_resume(tiny, rclient, keys):
    """Proof of resuming rather than regenerating: with another seed in the requeued message, a
    regenerated group would differ from index 0; a resumed one keeps every emitted token."""
    _, folder = tiny
    msg = group_msg(**SEEDED)
    whole, _ = run(make_engine(folder), Req(msg=msg, inbox_id="0-0"))
    tokens = first_attempt(folder, msg, steps=5, stop={})
    again = requeued(rclient, keys, msg, tokens, set(), lost=set())
    poisoned = again.model_copy(update={"params": again.params.model_copy(update={"seed": 999})})
    full, _ = resume_and_check(folder, poisoned)
    for c in range(3):
        assert full[c][:5] == whole[("g", c)][:5] == own_tokens(tokens, c)
        assert len(full[c]) == MAX_NEW
    assert any(full[c][5:] != whole[("g", c)][5:] for c in range(3))  # the poison took: later tokens differ


def test_a_requeued_group_counts_each_samples_emitted_tokens_for_admission():
    """Router and worker agree: the prompt once, each open sample's emitted tokens held and generated,
    the finished sample left out."""
    again = group_msg().model_copy(update={"group_resume": [[1, 2], [3], [4, 5, 6]], "finished_choices": [0]})
    expected = [ReqState(len(PROMPT) + 1, 1, MAX_NEW, 0), ReqState(3, 3, MAX_NEW, 0)]
    assert list(router_states(again)) == expected
    assert request_states([Req(msg=again, inbox_id="1-0")]) == expected


def test_cancelling_a_waiting_requeued_group_ends_each_open_sample_after_its_tokens(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    again = group_msg().model_copy(update={"group_resume": [[1, 2], [3], [4, 5, 6]], "finished_choices": [1]})
    leader = Req(msg=again, inbox_id="1-0")
    engine.add(leader)
    assert leader.choice == 0 and leader.output_ids == []  # its tokens come at the fork
    events = engine.cancel(leader)
    assert [(e.choice, e.num_output) for e in events if isinstance(e, Ended)] == [(0, 2), (2, 3)]
    assert isinstance(events[-1], Released) and not engine.has_work
