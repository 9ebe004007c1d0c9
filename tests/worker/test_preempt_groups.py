"""Groups paused for a better class (issue 33 item 7; real Redis, counting model, publisher in-process):
a group (n samples of one prompt) is one victim, all its samples stop together, it goes back to the
queue with each sample's tokens so far and the samples that ended, and the worker that resumes it
completes every sample with each (choice, index) written once and every token what an uninterrupted
run gives (the counting model: next token = last + 1, so every output is known in advance). A
request paused before it ever started here goes back as it came (it was dropped before)."""

from __future__ import annotations

import pytest
import torch

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.test_preempt import (  # noqa: F401 (fixture)
    MAX_NEW,
    POOL,
    ask,
    chunks,
    dispatch,
    make_worker,
    message,
    requeued,
    tokenizer,
)
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Preempted
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

PROMPT = [3] * 8  # the counting model answers 4, 5, 6, ...
EXPECTED = list(range(4, 4 + MAX_NEW))  # every sample's whole output


def group_message(request_id: str, emitted: list[int], priority: int = 1) -> GenerateRequest:
    """A group of len(emitted) samples; sample c emitted ``emitted[c]`` tokens in an earlier attempt."""
    resume = [EXPECTED[:k] for k in emitted] if any(emitted) else []
    return GenerateRequest(
        id=request_id,
        prompt_ids=PROMPT,
        params=SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        created_ms=0,
        priority=priority,
        n=len(emitted),
        group_resume=resume,
    )


def samples(worker, request_id: str) -> list[Req]:
    return [r for r in worker.engine.requests() if r.id == request_id]


@pytest.mark.parametrize(
    "emitted",
    [[0, 0, 0], [2, MAX_NEW - 6, 0]],
    ids=["fresh", "one-sample-ends-before-the-pause"],
)
def test_a_paused_group_resumes_elsewhere_and_every_sample_completes_exactly(
    redis_settings, rclient, keys, tokenizer, emitted
):
    """A group of 3 fills the pool (8 + 3 x 30 of 100 tokens); a class-0 request asks for room.
    "one-sample-ends-before-the-pause": a requeued group whose sample 1 is 6 tokens from its end:
    it ends on the first worker, goes back finished and is not run again."""
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    first = make_worker(redis_settings, rclient, tokenizer, "w-a")
    dispatch(rclient, keys, "w-a", group_message("g", emitted))
    ends_here = {c for c, k in enumerate(emitted) if k == MAX_NEW - 6}
    live = run_until_every_sample_sent(first, emitted, ends_here)
    outputs = {r.choice: list(r.output_ids) for r in live}
    held = len(PROMPT) + sum(map(len, outputs.values()))
    assert first.load(1).preemptible == [(1, held, len(live))]  # the group whole, its prompt once

    urgent = message("urgent", priority=0)
    dispatch(rclient, keys, "w-a", urgent)  # the router sends it with the ask
    ask(rclient, keys, "w-a", urgent)
    first._serve_once()
    assert [r.id for r in first.engine.requests()] == ["urgent"]  # every sample out, urgent admitted
    assert first.engine.num_preempted == 1 and first.engine.num_preempted_tokens >= held - len(live)
    (back,) = requeued(rclient, keys)
    assert (back.id, back.n, back.preemptions, back.finished_choices) == ("g", 3, 1, sorted(ends_here))
    for choice in range(3):  # the resume state is exactly what the client was sent
        written = [c.token_id for c in chunks(rclient, keys, "g") if c.choice == choice]
        expected = EXPECTED if choice in ends_here else outputs[choice]
        assert back.group_resume[choice] == EXPECTED[: emitted[choice]] + written == expected
    assert rclient.hget(keys.meta("g"), "status") == "queued" and rclient.xlen(keys.inbox("w-a")) == 1

    second = make_worker(redis_settings, rclient, tokenizer, "w-b")
    dispatch(rclient, keys, "w-b", back)
    while first.engine.has_work or second.engine.has_work or rclient.xlen(keys.inbox("w-b")):
        first._serve_once()
        second._serve_once()
    assert_complete(rclient, keys, emitted)
    assert rclient.hget(keys.meta("urgent"), "status") == "finished"


def run_until_every_sample_sent(worker, emitted: list[int], ends_here: set[int]) -> list[Req]:
    """Serve until the group forked, each open sample sent a token of this attempt and those of
    ``ends_here`` ended; its samples still running."""
    while not (
        len(samples(worker, "g")) == len(emitted) - len(ends_here)
        and all(len(r.output_ids) > emitted[r.choice] for r in samples(worker, "g"))
    ):
        worker._serve_once()
    return samples(worker, "g")


def assert_complete(rclient, keys, emitted: list[int]) -> None:
    """Every sample's whole output written exactly, after what it had emitted before this test."""
    written = chunks(rclient, keys, "g")
    for choice in range(3):  # each index once, over both workers, none lost, none repeated
        mine = [c for c in written if c.choice == choice]
        assert [c.index for c in mine] == list(range(emitted[choice], MAX_NEW)), choice
        assert [c.token_id for c in mine] == EXPECTED[emitted[choice] :], choice
    assert rclient.hget(keys.meta("g"), "status") == "finished"
    assert int(rclient.hget(keys.meta("g"), "output_tokens")) == 3 * MAX_NEW


def test_victims_that_never_started_go_back_as_they_came(redis_settings, rclient, keys, tokenizer):
    """Two requests run, a group waits behind them (it fits only once one ends). Asked for room,
    the worker pauses the waiting group (newest) and one running request: the group goes back
    unchanged, its pause not counted. Before, a victim that never started (no Started event) was
    released by the publisher, its inbox entry deleted and the request never requeued."""
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    worker = make_worker(redis_settings, rclient, tokenizer, "w-u")
    for request_id in ("a", "b"):
        dispatch(rclient, keys, "w-u", message(request_id, priority=1))
    waiting = group_message("g", [0, 0])
    dispatch(rclient, keys, "w-u", waiting)
    for _ in range(3):
        worker._serve_once()
    assert [r.id for r in worker.engine.running] == ["a", "b"] and [r.id for r in worker.engine.waiting] == ["g"]
    assert worker.load(1).preemptible == [(1, 2 * 8 + 2 * len(worker.engine.running[0].output_ids) + 8, 4)]

    ask(rclient, keys, "w-u", message("urgent", priority=0))
    worker._serve_once()
    back = {r.id: r for r in requeued(rclient, keys)}
    assert sorted(back) == ["b", "g"] and [r.id for r in worker.engine.requests()] == ["a"]
    assert back["g"] == waiting  # as it came: no progress, its pause not counted
    assert back["b"].preemptions == 1 and worker.engine.num_preempted == 1
    assert rclient.hget(keys.meta("g"), "status") == "queued" and rclient.xlen(keys.inbox("w-u")) == 1


def test_a_group_paused_before_its_fork_goes_back_with_the_progress_it_came_with():
    """Its leader was prefilling the prompt (4 of 8 tokens a step): no sample has a token of this
    attempt, so the group goes back as it came (not as its leader's sample), its pause counted."""
    cpu = torch.device("cpu")
    runner = ModelRunner(CountingModel(256, cpu), TokenPool(POOL), ReqTable(4, 64, POOL, cpu), 256, cpu, set(), None)
    rule = AdmissionRule(AdmissionSettings(admission="conservative"))
    engine = Engine(runner, EngineLimits(POOL, 4, 4), set(), rule)
    # A requeued seeded group: sample 0 ended, 2 had sent tokens; sample 1 leads (its own seed).
    msg = group_message("g", [MAX_NEW, 0, 5])
    msg = msg.model_copy(update={"finished_choices": [0], "params": msg.params.model_copy(update={"seed": 11})})
    engine.add(Req(msg=msg, inbox_id="1-0", epoch=3))
    engine.step()
    (leader,) = engine.running
    assert leader.is_unforked_leader and leader.num_cached == 4 and leader.msg.params.seed != 11
    (event,) = engine.preempt([leader])
    assert isinstance(event, Preempted) and event.epoch == 3
    assert event.msg == msg.model_copy(update={"preemptions": 1})
    assert engine.num_preempted == 1 and engine.num_preempted_tokens == 4
    assert engine.requests() == [] and runner.pool.num_free == POOL
