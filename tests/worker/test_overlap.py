"""The overlapped engine (``Engine.overlap``: a decode's tokens land in the next step, after its
forward is launched) publishes exactly what the plain engine does, on a tiny random Llama on the
CPU (where nothing really overlaps, but the bookkeeping is the same as on a GPU): the same tokens
and finish reasons per sample for a mixed workload (greedy, seeded sampling, penalties, top
logprobs, groups, EOS ends found a step late, pauses under a small pool, the prefix cache), each
index once; cancels, stop strings and preemptions between steps drop the token in flight; a
constrained request's grammar advances on landed tokens. And the decode really was launched
before its input ids reached the host."""

from __future__ import annotations

import json

import pytest

from shared.schemas import GenerateRequest, SamplingParams
from tests.worker import test_grammar
from tests.worker.test_engine import req, tiny  # noqa: F401 (fixture)
from tests.worker.test_grammar import SAMPLED, SHORT_SCHEMA, cache, tokenizer  # noqa: F401 (fixtures)
from tests.worker.test_grammar import tiny as grammar_tiny  # noqa: F401 (fixture)
from tests.worker.test_prefix_cache_engine import SYSTEM, assert_idle, make_engine
from tests.worker.token_rows import flat
from worker.engine.events import Ended, Preempted, Token
from worker.engine.request import Req

EOS = {65, 76, 92}  # of the tiny model's 97 ids, some it draws often: requests end on EOS now and then
Outputs = dict[tuple[str, int], tuple[list[int], str | None]]
SEED, PAUSE_AT = 42, 4  # a group whose sample ends on EOS before the pause


def workload(long: bool = False) -> dict[int, list[Req]]:
    """Fresh requests by the step they arrive at: every kind of row a decode batch can hold;
    ``long`` adds six that run 30 tokens whatever they draw (past a short estimate: pauses)."""

    def sampled(rid: str, prompt: list[int], max_new: int, seed: int, **params) -> Req:
        return req(rid, prompt, max_new, do_sample=True, temperature=1.0, seed=seed, **params)

    msg = GenerateRequest(
        id="g",
        prompt_ids=SYSTEM + [4, 5],
        params=SamplingParams(max_new_tokens=9, do_sample=True, temperature=1.0, seed=5),
        created_ms=0,
        n=3,
    )
    return {
        0: [req("a", SYSTEM + [1, 2, 3], 12), sampled("b", [7, 8, 9], 20, seed=1)],
        1: [sampled("c", SYSTEM + [6], 16, seed=2, top_k=20, repetition_penalty=1.3, presence_penalty=0.5)],
        2: [req("d", [11, 12], 7, top_logprobs=3), Req(msg=msg, inbox_id="g-0")],
        4: [sampled("e", SYSTEM + [1, 2, 9], 14, seed=3, min_new_tokens=5), req("f", [40] * 30, 1)],
        7: [sampled("h", [50, 51], 18, seed=4, top_p=0.9)],
        3: [req(f"r{i}", SYSTEM[:20] + [3 + i, 7], 30, ignore_eos=True) for i in range(6 if long else 0)],
    }


def run(engine, arrivals: dict[int, list[Req]], between=None, first: int = 0) -> Outputs:
    """Every request to its end; ``between(step, engine)`` runs between steps and returns events.
    Checks that each sample's indexes are ``first``, ``first`` + 1, ... and nothing follows its end."""
    outputs: Outputs = {}
    ended: set[tuple[str, int]] = set()
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for r in arrivals.get(step, []):
            engine.add(r)
        events = flat(engine.step()) + flat(between(step, engine) if between else [])
        for event in events:
            if isinstance(event, Token):
                key = (event.request_id, event.choice)
                assert key not in ended, f"{key}: a token after its end"
                tokens, _ = outputs.setdefault(key, ([], None))
                assert event.index == first + len(tokens), f"{key}: index {event.index} after {len(tokens)} tokens"
                tokens.append(event.token_id)
                if event.finish_reason:
                    outputs[key] = (tokens, event.finish_reason)
                    ended.add(key)
            elif isinstance(event, (Ended, Preempted)):
                ended.add((event.request_id, getattr(event, "choice", 0)))
        step += 1
    return outputs


def engine_for(folder, overlap: bool, **kw):
    engine = make_engine(folder, **kw)
    engine.eos_ids = EOS
    engine.overlap = overlap
    engine.rule.learn([3] * 10)  # outputs are short, says the history: under past-future the pool overflows
    return engine


def count_device_id_decodes(engine) -> list[bool]:
    """Wrap the runner's forward: the list gets, per decode forward, whether its ids were on the device."""
    seen: list[bool] = []
    forward = engine.runner.forward

    def counting(step):
        if step.is_decode:
            seen.append(step.ids_on_device)
        return forward(step)

    engine.runner.forward = counting
    return seen


@pytest.mark.parametrize("cache, pool", [(False, 400), (True, 400), (True, 100)], ids=["plain", "cache", "pauses"])
def test_the_overlapped_engine_publishes_what_the_plain_one_does(tiny, cache, pool):  # noqa: F811
    _, folder = tiny
    long = pool < 400
    admission = "past_future" if long else "conservative"
    plain = run(engine_for(folder, False, cache=cache, pool=pool, admission=admission), workload(long))
    engine = engine_for(folder, True, cache=cache, pool=pool, admission=admission)
    device_ids = count_device_id_decodes(engine)
    overlapped = run(engine, workload(long))
    assert overlapped == plain
    assert len(plain) == 10 + 6 * long  # every sample (the group's three) ended
    assert sum(reason == "stop" for _, reason in plain.values()) >= 2  # EOS ends, found a step late
    assert engine.num_discarded >= 2  # ... each cost one sampled token that was never published
    assert sum(device_ids) > len(device_ids) / 2  # most decodes were launched before their ids landed
    if pool < 400:
        assert engine.num_pauses > 0
    assert_idle(engine, pool)


def test_ends_between_steps_drop_the_token_in_flight(tiny):  # noqa: F811
    """A cancel, a stop string (the publisher's) and a preemption land between steps, while each
    request has a token in flight: none of those is published, and the preempted request, resumed
    from what it emitted, continues as if never paused (greedy)."""
    _, folder = tiny
    uninterrupted = run(engine_for(folder, False, cache=True), {0: [req("p", [5, 6, 7], 15)]})
    engine = engine_for(folder, True, cache=True)
    resumed: list[GenerateRequest] = []

    def between(step: int, engine) -> list:
        if step != 3:
            return []
        by_id = {r.id: r for r in engine.running}
        assert engine._in_flight is not None and {"x", "y", "p"} <= {r.id for r in engine._in_flight.reqs}
        events = engine.cancel(by_id["x"]) + engine.stop(by_id["y"]) + engine.preempt([by_id["p"]])
        resumed.append(next(e.msg for e in events if isinstance(e, Preempted)))
        return events

    arrivals = {0: [req("x", [9, 9], 15), req("y", [8, 8], 15), req("p", [5, 6, 7], 15)]}
    outputs = run(engine, arrivals, between)
    emitted = outputs[("p", 0)][0]
    assert resumed[0].resume_ids == emitted and len(emitted) == 3  # steps 0..3: prefill + 3 landed decodes
    assert len(outputs[("x", 0)][0]) == len(outputs[("y", 0)][0]) == 3
    assert engine.num_discarded == 3  # each had one in flight
    rest = run(engine, {0: [Req(msg=resumed[0], inbox_id="p-1")]}, first=len(emitted))
    assert emitted + rest[("p", 0)][0] == uninterrupted[("p", 0)][0]
    assert_idle(engine, 400)


def test_a_constrained_request_advances_its_grammar_on_landed_tokens(grammar_tiny, tokenizer, cache):  # noqa: F811
    """Grammar masks are filled after the previous step lands (between the forward and the sampling):
    sampled answers under a schema are the plain engine's, and parse."""
    outputs = []
    for overlap in (False, True):
        engine = test_grammar.make_engine(grammar_tiny, cache)
        engine.overlap = overlap
        reqs = [Req(msg=test_grammar.msg(f"j{i}", SHORT_SCHEMA, 30, seed=i, **SAMPLED), inbox_id="-") for i in range(3)]
        outputs.append(test_grammar.run(engine, *reqs))
        tokens, reasons = outputs[-1]
        for key, ids in tokens.items():
            assert reasons[key] == "stop"
            assert 0 <= json.loads(tokenizer.decode(ids[:-1]))["n"] <= 999  # the last: the stop token
    assert outputs[0] == outputs[1]


def test_a_group_paused_with_tokens_in_flight_resumes_each_sample_as_if_never_paused(tiny):  # noqa: F811
    """A seeded group (its samples differ; EOS ends one early) is paused for a better class while its
    samples have tokens in flight: none of those is published, the group goes back with each
    sample's landed tokens and the sample that ended finished, and resumed (its prompt from the
    cache) every open sample continues at its next index and ends as the uninterrupted run's did."""
    _, folder = tiny

    def group() -> Req:
        params = SamplingParams(max_new_tokens=14, do_sample=True, temperature=1.0, seed=SEED)
        return Req(
            msg=GenerateRequest(id="g", prompt_ids=SYSTEM + [4, 5], params=params, created_ms=0, n=3), inbox_id="-"
        )

    uninterrupted = run(engine_for(folder, False, cache=True), {0: [group()]})
    engine = engine_for(folder, True, cache=True)
    back: list[GenerateRequest] = []

    def between(step: int, engine) -> list:
        if step != PAUSE_AT:
            return []
        assert engine._in_flight is not None and len(engine._in_flight.reqs) == 2  # one sample ended
        events = engine.preempt([engine.running[-1]])  # any sample: the whole group goes
        back.extend(e.msg for e in events if isinstance(e, Preempted))
        return events

    first = run(engine, {0: [group()]}, between)
    (msg,) = back
    assert engine.requests() == [] and engine.num_discarded == 2 and msg.preemptions == 1
    assert msg.group_resume == [first[("g", c)][0] for c in range(3)]
    assert msg.finished_choices == [c for c in range(3) if first[("g", c)][1] is not None] != []
    engine.add(Req(msg=msg, inbox_id="-"))
    rest: dict[int, list[Token]] = {}
    while engine.has_work:
        for event in flat(engine.step()):
            if isinstance(event, Token):
                rest.setdefault(event.choice, []).append(event)
    assert sorted(rest) == msg.open_choices
    for choice in range(3):
        before, after = msg.group_resume[choice], rest.get(choice, [])
        assert [t.index for t in after] == list(range(len(before), len(before) + len(after)))
        assert before + [t.token_id for t in after] == uninterrupted[("g", choice)][0]
    assert_idle(engine, 400)
