"""The engine with the prefix cache on, on a tiny random Llama: greedy tokens equal the cache
off's for requests sharing prefixes (arriving while others run and after they ended), a group,
pauses under a small pool and a requeued request; cached prefixes are really skipped; admission
counts a prefix running requests hold once; every slot is held, free or evictable at the end."""

import torch

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.model_files import ModelSource
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.test_engine import req, run_to_end, tiny  # noqa: F401 (fixture)
from tests.worker.test_engine_groups import group, run
from worker.engine.engine import Engine, EngineLimits
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

SYSTEM = list(range(30, 70))  # a 40-token "system prompt" every request below starts with


def make_engine(
    folder, cache: bool, pool: int = 400, admission: str = "conservative", batch_max_tokens: int = 64, loaded=None
):
    """``loaded``: another (model, config) than the tiny one in ``folder``, given a fresh pool."""
    model, config = loaded or load_model(ModelSource("hf", folder), torch.float32, "cpu")
    kv = attach_kv_cache(model, pool, "cpu")
    slots = TokenPool(pool)
    runner = ModelRunner(
        model,
        slots,
        ReqTable(8, 256, kv.hold_slot, "cpu"),
        config.vocab_size,
        torch.device("cpu"),
        prefix_cache=RadixCache(slots) if cache else None,
    )
    rule = AdmissionRule(AdmissionSettings(admission=admission, history_window=10, history_prior=5))
    return Engine(runner, EngineLimits(pool, batch_max_tokens, 8), eos_ids=set(), rule=rule)


def assert_idle(engine, pool: int) -> None:
    slots = engine.runner.slots
    assert slots.num_held == 0 and slots.available == pool
    assert engine.runner.table.num_free_rows == 8


def both(folder, arrivals_of, **kw):
    """Tokens with the cache off and on (fresh requests each), and the cached engine."""
    off = run_to_end(make_engine(folder, False, **kw), arrivals_of())
    engine = make_engine(folder, True, **kw)
    return off, run_to_end(engine, arrivals_of()), engine


def test_shared_prefixes_hit_and_give_the_same_greedy_tokens(tiny):  # noqa: F811
    _, folder = tiny

    def arrivals():
        return {
            0: [req("a", SYSTEM + [1, 2, 3], 6)],
            2: [req("b", SYSTEM + [1, 2, 4, 5], 6)],  # a is running: its prefill was shared
            12: [req("c", SYSTEM + [1, 2, 3] + [9] * 6, 5), req("d", SYSTEM[:20] + [7], 4)],  # after a ended
            13: [req("e", SYSTEM + [1, 2, 3], 3)],  # a's whole prompt: all but its last token cached
        }

    off, on, engine = both(folder, arrivals)
    assert on == off
    slots = engine.runner.slots
    assert slots.num_hit >= 42 + 40 + 20 + 42  # b, c, d, e skipped at least their shared prefix
    assert_idle(engine, 400)


def test_a_group_with_a_cached_prompt_equals_the_cache_off(tiny):  # noqa: F811
    _, folder = tiny
    outputs = []
    for cache in (False, True):
        engine = make_engine(folder, cache)
        first, _ = run(engine, req("warm", SYSTEM + [5], 4))
        tokens, _ = run(engine, group("g", SYSTEM + [5, 6], 6, n=3), req("single", SYSTEM + [8], 5))
        outputs.append((first, tokens))
        if cache:
            assert engine.runner.slots.num_hit >= 41 + 40
            assert_idle(engine, 400)
    assert outputs[0] == outputs[1]


def test_pauses_under_a_small_pool_resume_from_the_cache_and_match(tiny):  # noqa: F811
    _, folder = tiny

    def arrivals():  # the history says outputs are short (5); these run 30: the pool overflows
        return {0: [req(f"r{i}", SYSTEM[:20] + [3 + i, 7], 30) for i in range(6)]}

    engines = []
    outputs = []
    for cache in (False, True):
        engine = make_engine(folder, cache, pool=150, admission="past_future")
        engine.rule.learn([5] * 10)
        outputs.append(run_to_end(engine, arrivals()))
        engines.append(engine)
    assert outputs[0] == outputs[1]
    assert engines[1].num_pauses > 0 and engines[1].runner.slots.cache.num_evicted > 0
    assert_idle(engines[1], 150)


def test_a_requeued_request_resumes_after_its_emitted_tokens_from_the_cache(tiny):  # noqa: F811
    _, folder = tiny
    whole = run_to_end(make_engine(folder, False), {0: [req("x", SYSTEM + [4], 10)]})["x"]
    engine = make_engine(folder, True)
    run_to_end(engine, {0: [req("x", SYSTEM + [4], 6)]})  # the first worker's run, left in the cache
    msg = GenerateRequest(
        id="x", prompt_ids=SYSTEM + [4], params=SamplingParams(max_new_tokens=10), created_ms=0, resume_ids=whole[:6]
    )
    rest = run_to_end(engine, {0: [Req(msg=msg, inbox_id="x-1")]})["x"]
    assert whole[:6] + rest == whole
    assert engine.runner.slots.num_hit >= 41 + 5  # prompt and the emitted tokens it had fed


def test_admission_counts_a_prefix_running_requests_hold_once(tiny):  # noqa: F811
    """Conservative, pool 100: each request needs 41 + 10; two fit only if the 40 shared tokens
    count once (51 + 11 = 62), three with the cache (73), never without (153)."""
    _, folder = tiny
    running = []
    for cache in (False, True):
        engine = make_engine(folder, cache, pool=100)
        engine.add(req("first", SYSTEM + [1], 10))
        engine.step()  # prefilled and shared
        for i in range(2):
            engine.add(req(f"next{i}", SYSTEM + [2 + i], 10))
        engine.step()
        running.append(len(engine.running))
        run_to_end(engine, {})
        assert engine.runner.slots.num_held == 0
    assert running == [1, 3]


def test_a_requeued_group_resumes_each_sample_the_same_from_the_cache(tiny, rclient, keys):  # noqa: F811
    """A group's first worker dies after 5 steps (shared.requeue); the next worker, which holds the
    prompt and more from an earlier request, gives each sample the tokens the cache off gives."""
    from tests.worker.test_group_resume import PROMPT, first_attempt, group_msg, requeued

    _, folder = tiny
    msg = group_msg()
    again = requeued(rclient, keys, msg, first_attempt(folder, msg, 5, {}), set(), set())
    assert any(again.emitted(c) for c in again.open_choices)
    outputs = []
    for cache in (False, True):
        engine = make_engine(folder, cache)
        run(engine, req("warm", PROMPT + [40, 41], 3))  # the prompt and more, in the cache when on
        tokens, _ = run(engine, Req(msg=again, inbox_id="2-0"))
        outputs.append(tokens)
        if cache:
            assert engine.runner.slots.num_hit >= len(PROMPT) - 1
            assert_idle(engine, 400)
    assert outputs[0] == outputs[1]


def test_the_load_record_says_what_the_cache_holds(tiny):  # noqa: F811
    from shared.prefix_hash import prefix_hashes
    from worker.engine.load import build_load

    _, folder = tiny
    engine = make_engine(folder, True)
    prompt = [(i * 7) % 90 + 1 for i in range(130)]  # within the tiny vocabulary
    run_to_end(engine, {0: [req("long", prompt, 4)]})
    load = build_load(engine, "w", 1, "0-0")
    assert dict(load.prefixes)[prefix_hashes(prompt)[1]] == 128  # both 64-token boundaries, as the router hashes
    assert dict(load.prefixes)[prefix_hashes(prompt)[0]] == 64
    assert load.cached_tokens == 133 and load.used_tokens == 0 and load.requests == []


def test_paused_group_samples_resume_from_the_cache_and_match(tiny):  # noqa: F811
    """Groups sharing a prefix overflow a small pool: samples are paused (their prompt leased by the
    group, or by the tree once the group let go) and resume from the cache, as with it off."""
    _, folder = tiny
    outputs, engines = [], []
    for cache in (False, True):
        engine = make_engine(folder, cache, pool=200, admission="past_future")
        engine.rule.learn([5] * 10)
        tokens, _ = run(engine, *[group(f"g{i}", SYSTEM[:16] + [3 + i, 7], 30, n=3) for i in range(4)])
        outputs.append(tokens)
        engines.append(engine)
    assert outputs[0] == outputs[1]
    assert engines[1].num_pauses > 0 and engines[1].runner.slots.num_hit > 0
    assert_idle(engines[1], 200)


def test_a_burst_sharing_a_prefix_waits_for_its_first_prefill(tiny):  # noqa: F811
    """Five requests sharing a 42-token prefix arrive at once: one prefills it, the others wait a
    step and find it cached (without the wait each would prefill it: no hits at all); the tokens
    equal the cache off's. A request sharing fewer than ``shared_min`` tokens does not wait."""
    _, folder = tiny

    def arrivals():
        burst = [req(f"r{i}", SYSTEM + [1, 2, i + 3], 5) for i in range(5)]
        return {0: [*burst, req("short", SYSTEM[:10] + [8, 9], 5)]}

    off = run_to_end(make_engine(folder, False, batch_max_tokens=256), arrivals())
    engine = make_engine(folder, True, batch_max_tokens=256)
    engine.runner.slots.shared_min = 16
    waiting_after_one_step: list[str] = []

    class Watch(dict):  # run_to_end's arrivals: records who waits after the first step
        def get(self, step, default=None):
            if step == 1:
                waiting_after_one_step.extend(r.id for r in engine.waiting)
            return super().get(step, default)

    on = run_to_end(engine, Watch(arrivals()))
    assert waiting_after_one_step == ["r1", "r2", "r3", "r4"]  # "short" shares 10 tokens: it went
    assert on == off
    assert engine.runner.slots.num_hit >= 4 * 42  # r1-r4: the 40 shared tokens and [1, 2]
    assert_idle(engine, 400)
