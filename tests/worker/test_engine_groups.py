"""Groups (n samples of one prompt) in the engine on a tiny random Llama: the
prompt is prefilled once and its slots shared, greedy samples equal a single
request's output, seeded groups are reproducible, admission counts the
prompt once, and every slot and row comes back however the samples end."""

import pytest

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.peak import ReqState, group_states
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.test_engine import POOL, make_engine, reference_greedy, tiny  # noqa: F401 (fixture)
from tests.worker.token_rows import flat
from worker.engine.events import Ended, Released, Started, Token
from worker.engine.load import request_states
from worker.engine.request import Req

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def group(rid, prompt, max_new, n, **params):
    msg = GenerateRequest(
        id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, **params), created_ms=0, n=n
    )
    return Req(msg=msg, inbox_id=f"{rid}-0")


def count_prefill_tokens(engine) -> list[int]:
    """Wrap the runner's prefill: the returned list collects each call's new-token count."""
    fed: list[int] = []
    prefill = engine.runner.prefill

    def counting(reqs, num_new, completing, forks=None):
        fed.append(sum(num_new))
        return prefill(reqs, num_new, completing, forks)

    engine.runner.prefill = counting
    return fed


def run(engine, *reqs) -> tuple[dict[tuple[str, int], list[int]], list]:
    for r in reqs:
        engine.add(r)
    tokens: dict[tuple[str, int], list[int]] = {}
    events = []
    while engine.has_work:
        for event in flat(engine.step()):
            events.append(event)
            if isinstance(event, Token):
                tokens.setdefault((event.request_id, event.choice), []).append(event.token_id)
    return tokens, events


def test_greedy_group_prefills_once_and_each_sample_equals_a_single_request(tiny):
    ref, folder = tiny
    engine = make_engine(folder)
    fed = count_prefill_tokens(engine)
    free_before = engine.runner.pool.num_free
    tokens, events = run(engine, group("g", PROMPT, 12, n=3))
    expected = reference_greedy(ref, PROMPT, 12)
    assert [tokens[("g", c)] for c in range(3)] == [expected] * 3
    assert sum(fed) == len(PROMPT)  # one prefill of the prompt for the whole group
    assert [type(e) for e in events].count(Started) == 1 and [type(e) for e in events].count(Released) == 1
    assert isinstance(events[-1], Released)  # the inbox entry goes with the last sample
    assert engine.runner.pool.num_free == free_before == POOL
    assert engine.runner.table.num_free_rows == 8


def test_group_holds_the_prompt_once_while_decoding(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    engine.add(group("g", PROMPT, 20, n=3))
    engine.step()  # prefill + fork: each sample has its first token (not in the pool yet)
    assert engine.runner.pool.num_used == len(PROMPT)
    engine.step()  # each sample feeds its token
    assert engine.runner.pool.num_used == len(PROMPT) + 3
    states = request_states(engine.running)
    assert states == [ReqState(len(PROMPT) + 2, 2, 20, 0), ReqState(2, 2, 20, 0), ReqState(2, 2, 20, 0)]


def test_the_load_counts_every_sample_while_the_fork_is_under_way(tiny):
    """The heartbeat thread summarises the engine's requests at any moment: one taken between the
    runner's fork (before the prefill's forward) and the engine's listing of the members (after
    it) still counts the whole group. It once showed the leader alone there (248 of 728 tokens in
    the preemption test's pool), and a router sent a better class to a worker it did not fit."""
    _, folder = tiny
    engine = make_engine(folder)
    seen: list[list[ReqState]] = []
    prefill = engine.runner.prefill

    def forking(reqs, num_new, completing, forks=None):
        pending = prefill(reqs, num_new, completing, forks)  # forked, members not listed yet
        seen.append(request_states(engine.requests()))  # what a beat on another thread reads
        return pending

    engine.runner.prefill = forking
    engine.add(group("g", PROMPT, 20, n=3))
    engine.step()
    assert seen == [group_states(len(PROMPT), [0, 0, 0], 20, 0)]
    assert len(request_states(engine.requests())) == 3  # listed: each sample counts itself


def test_seeded_group_is_reproducible_and_its_samples_differ(tiny):
    _, folder = tiny
    params = dict(do_sample=True, temperature=1.5, seed=1234)
    first, _ = run(make_engine(folder), group("g", PROMPT, 16, n=3, **params))
    again, _ = run(make_engine(folder), group("g", PROMPT, 16, n=3, **params))
    single, _ = run(make_engine(folder), group("s", PROMPT, 16, n=1, **params))
    assert first == again
    assert len({tuple(first[("g", c)]) for c in range(3)}) == 3  # three random streams
    assert first[("g", 0)] == single[("s", 0)]  # sample 0 keeps the request's own seed


def test_group_admission_counts_the_prompt_once():
    states = group_states(100, [0, 0, 0], 50, 0)
    assert sum(s.conservative_need for s in states) == 100 + 3 * 50
    assert [s.held for s in states] == [100, 0, 0]
    waiting = group("g", [1] * 100, 50, n=3)
    assert request_states([waiting]) == states


def test_conservative_pool_fits_a_group_exactly_where_separate_requests_would_not(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    prompt = [3] * 50
    engine.add(group("g", prompt, 50, n=3))  # 50 + 3 x 50 = 200 = POOL
    engine.add(group("h", [4], 1, n=1))  # its 2 tokens would not fit beside it
    started = [e.request_id for e in flat(engine.step()) if isinstance(e, Started)]
    assert started == ["g"] and engine.snapshot().committed_tokens == 202
    assert engine.runner.table.num_free_rows == 8 - 3  # the fork took a row per sample
    separate = make_engine(folder)
    for i in range(3):
        separate.add(group(f"s{i}", prompt, 50, n=1))  # 3 x (50 + 50): the prompt three times
    assert [e.request_id for e in flat(separate.step()) if isinstance(e, Started)] == ["s0", "s1"]


def test_cancel_frees_every_sample_of_a_group(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    g = group("g", PROMPT, 50, n=3)
    engine.add(g)
    for _ in range(3):
        engine.step()
    events = []
    for r in list(engine.running):
        events += engine.cancel(r)
    assert sorted(e.choice for e in events if isinstance(e, Ended)) == [0, 1, 2]
    assert [type(e) for e in events].count(Released) == 1 and isinstance(events[-1], Released)
    assert engine.runner.pool.num_free == POOL and engine.runner.table.num_free_rows == 8
    assert not engine.has_work


def test_cancel_of_a_waiting_group_ends_all_its_samples(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    g = group("g", PROMPT, 50, n=4)
    engine.add(g)
    events = engine.cancel(g)
    assert [e.choice for e in events if isinstance(e, Ended)] == [0, 1, 2, 3]
    assert isinstance(events[-1], Released) and not engine.has_work


def test_a_stopped_sample_leaves_the_others_running(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    engine.add(group("g", PROMPT, 30, n=3))
    engine.step()
    member = next(r for r in engine.running if r.choice == 1)
    assert engine.stop(member) == []  # not the last sample: the inbox entry stays
    assert len(engine.running) == 2
    _, events = run(engine)
    assert isinstance(events[-1], Released) and engine.runner.pool.num_free == POOL


@pytest.mark.parametrize("n", [2, 4])
def test_paused_samples_recompute_their_own_copy_and_still_match(tiny, n):
    ref, folder = tiny
    engine = make_engine(folder)
    # The history says outputs are short (5 tokens); these run 40: the pool (200) overflows.
    engine.rule = AdmissionRule(AdmissionSettings(admission="past_future", history_window=10, history_prior=5))
    engine.rule.learn([5] * 10)
    prompts = {f"g{i}": [3 + i, 7, 11 + i, 13, 17, 19] for i in range(4)}
    tokens, _ = run(engine, *[group(rid, p, 40, n=n) for rid, p in prompts.items()])
    assert engine.num_pauses > 0
    for rid, prompt in prompts.items():
        expected = reference_greedy(ref, prompt, 40)
        assert [tokens[(rid, c)] for c in range(n)] == [expected] * n, rid
    assert engine.runner.pool.num_free == POOL and engine.runner.table.num_free_rows == 8
