"""The continuous-batching engine on a tiny random Llama: tokens equal
transformers' greedy generate, with requests joining mid-flight, and every
slot comes back when requests finish or are cancelled."""

import pytest
import torch
import transformers

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.model_files import ModelSource
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.token_rows import flat
from worker.engine.engine import Engine, EngineLimits
from worker.engine.events import Ended, Released, Started, Token
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

POOL = 200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        max_position_embeddings=256,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(folder)
    return ref, str(folder)


def make_engine(folder, running_max=8, batch_max_tokens=64):
    model, config = load_model(ModelSource("hf", folder), torch.float32, "cpu")
    cache = attach_kv_cache(model, POOL, "cpu")
    table = ReqTable(running_max, 128, cache.hold_slot, "cpu")
    runner = ModelRunner(model, TokenPool(POOL), table, config.vocab_size, torch.device("cpu"))
    return Engine(
        runner,
        EngineLimits(POOL, batch_max_tokens, running_max),
        eos_ids=set(),
        rule=AdmissionRule(AdmissionSettings(admission="conservative")),
    )


def req(rid, prompt, max_new, **params):
    msg = GenerateRequest(
        id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=max_new, **params), created_ms=0
    )
    return Req(msg=msg, inbox_id=f"{rid}-0")


def reference_greedy(ref, prompt, max_new):
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def run_to_end(engine, arrivals):
    """Step the engine; ``arrivals[step]`` requests join before that step."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_work or any(s >= step for s in arrivals):
        for r in arrivals.get(step, []):
            engine.add(r)
        for event in flat(engine.step()):
            if isinstance(event, Token):
                tokens.setdefault(event.request_id, []).append(event.token_id)
        step += 1
    return tokens


def test_continuous_batching_matches_transformers_greedy(tiny):
    ref, folder = tiny
    engine = make_engine(folder)
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 3], "c": list(range(20, 40))}
    arrivals = {0: [req("a", prompts["a"], 12)], 3: [req("b", prompts["b"], 6), req("c", prompts["c"], 9)]}
    tokens = run_to_end(engine, arrivals)
    for rid, r in [("a", 12), ("b", 6), ("c", 9)]:
        assert tokens[rid] == reference_greedy(ref, prompts[rid], r), rid
    assert engine.runner.pool.num_free == POOL
    assert engine.runner.table.num_free_rows == 8


def test_a_step_with_a_prefill_runs_it_as_its_own_forward_before_the_decode(tiny):
    """A prompt chunk beside decoding requests: the prefill forward, then the decode one."""
    ref, folder = tiny
    engine = make_engine(folder, batch_max_tokens=8)
    forwards: list[bool] = []  # is_decode of each forward of the current step
    real_forward = engine.runner.forward
    engine.runner.forward = lambda step: forwards.append(step.is_decode) or real_forward(step)
    prompts = {"a": [5, 6, 7], "b": list(range(30, 50))}  # b: three chunks of 8 beside a's decoding
    engine.add(req("a", prompts["a"], 10))
    tokens: dict[str, list[int]] = {}
    per_step = []
    for step in range(30):
        if step == 2:
            engine.add(req("b", prompts["b"], 6))
        forwards.clear()
        for e in flat(engine.step()):
            if isinstance(e, Token):
                tokens.setdefault(e.request_id, []).append(e.token_id)
        per_step.append(list(forwards))
        if not engine.has_work:
            break
    assert tokens["a"] == reference_greedy(ref, prompts["a"], 10)
    assert tokens["b"] == reference_greedy(ref, prompts["b"], 6)
    prefill_steps = per_step[2:5]  # b's chunks of 8, 8 and 4 tokens, while a decodes
    assert prefill_steps == [[False, True]] * 3  # is_decode of each forward: the prefill first
    assert engine.runner.pool.num_free == POOL


def test_a_new_requests_first_token_is_handed_over_before_the_decode_runs(tiny):
    ref, folder = tiny
    engine = make_engine(folder)
    log: list = []
    real_forward = engine.runner.forward
    engine.runner.forward = lambda step: log.append("decode" if step.is_decode else "prefill") or real_forward(step)
    engine.add(req("a", [5, 6, 7], 4))
    engine.step()
    engine.add(req("b", [11, 3], 4))
    log.clear()
    rest = engine.step(early=lambda events: log.append([(type(e).__name__, e.request_id) for e in flat(events)]))
    # Started before its first forward (a death in it counts against it), its first token before the decode
    assert log == [[("Started", "b")], "prefill", [("Token", "b")], "decode"]
    assert [(type(e).__name__, e.request_id) for e in flat(rest)] == [("Token", "a")]


def test_resumed_request_continues_after_its_emitted_tokens(tiny):
    ref, folder = tiny
    prompt = [4, 8, 15, 16, 23, 42]
    full = reference_greedy(ref, prompt, 10)
    engine = make_engine(folder)
    msg = GenerateRequest(
        id="r",
        prompt_ids=prompt,
        params=SamplingParams(max_new_tokens=10),
        created_ms=0,
        attempt=1,
        resume_ids=full[:4],
    )
    engine.add(Req(msg=msg, inbox_id="1-0"))
    events = []
    while engine.has_work:
        events += flat(engine.step())
    got = [e for e in events if isinstance(e, Token)]
    assert [e.index for e in got] == list(range(4, 10))
    assert [e.token_id for e in got] == full[4:]


def test_cancel_frees_slots_at_once_and_reports(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    a, b = req("a", [1, 2, 3], 50), req("b", [4, 5], 50)
    engine.add(a)
    engine.add(b)
    engine.step()
    engine.step()
    assert engine.runner.pool.num_used == 3 + 1 + 2 + 1  # prompts + one decoded token each in the pool
    events = engine.cancel(a)
    assert isinstance(events[0], Ended) and events[0].reason == "cancelled" and isinstance(events[1], Released)
    assert engine.runner.pool.num_used == 2 + 1
    assert engine.snapshot().num_running == 1 and engine.snapshot().committed_tokens == 52


def test_admission_respects_pool_batch_and_count_limits(tiny):
    _, folder = tiny
    engine = make_engine(folder, running_max=2, batch_max_tokens=64)
    for i in range(3):
        engine.add(req(f"r{i}", [1] * 10, 5))
    started = [e for e in flat(engine.step()) if isinstance(e, Started)]
    assert [e.request_id for e in started] == ["r0", "r1"]
    assert engine.snapshot().num_waiting == 1


def test_chunked_prefill_keeps_decoding_and_matches_transformers(tiny):
    ref, folder = tiny
    engine = make_engine(folder, batch_max_tokens=8)
    short, long_prompt = [5, 6, 7], list(range(30, 70))  # 40 tokens: five chunks of 8
    engine.add(req("short", short, 10))
    engine.step()
    engine.add(req("long", long_prompt, 5))
    short_tokens_during_long_prefill = 0
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        events = flat(engine.step())
        got = {e.request_id for e in events if isinstance(e, Token)}
        if "long" not in tokens and "short" in got:
            short_tokens_during_long_prefill += 1
        for e in events:
            if isinstance(e, Token):
                tokens.setdefault(e.request_id, []).append(e.token_id)
    assert short_tokens_during_long_prefill >= 4  # the long prompt did not stall decoding
    assert tokens["long"] == reference_greedy(ref, long_prompt, 5)
    assert tokens["short"][-9:] == reference_greedy(ref, short, 10)[1:]
    assert engine.runner.pool.num_free == POOL


def test_penalties_apply_per_request_in_one_batch(tiny):
    _, folder = tiny
    engine = make_engine(folder)
    prompt = [5, 6, 7]
    engine.add(req("plain", prompt, 30))
    engine.add(req("penalised", prompt, 30, presence_penalty=1000.0))
    tokens = run_to_end(engine, {})
    assert len(set(tokens["penalised"])) == 30  # never the same token twice
    assert len(set(tokens["plain"])) < 30  # the tiny random model repeats itself unpenalised


def test_past_future_overcommits_pauses_and_still_matches_transformers(tiny):
    ref, folder = tiny
    engine = make_engine(folder)
    # The history says outputs are short (5 tokens); these run 40: the pool (200) overflows.
    engine.rule = AdmissionRule(AdmissionSettings(admission="past_future", history_window=10, history_prior=5))
    engine.rule.learn([5] * 10)
    prompts = {f"r{i}": [3 + i, 7, 11 + i, 13, 17] for i in range(8)}
    tokens = run_to_end(engine, {0: [req(rid, p, 40) for rid, p in prompts.items()]})
    assert engine.num_pauses > 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_greedy(ref, prompt, 40), rid
    assert engine.runner.pool.num_free == POOL


def test_waiting_requests_start_by_priority_class_then_arrival(tiny):
    _, folder = tiny
    engine = make_engine(folder, running_max=2, batch_max_tokens=64)
    arrivals = [("low-a", 1), ("low-b", 1), ("mid", 0), ("high", -1), ("mid-late", 0), ("low-c", 1)]
    for rid, priority in arrivals:
        params = SamplingParams(max_new_tokens=5)
        msg = GenerateRequest(id=rid, prompt_ids=[1] * 10, params=params, priority=priority, created_ms=0)
        engine.add(Req(msg=msg, inbox_id=f"{rid}-0"))
    assert [r.id for r in engine.waiting] == ["high", "mid", "mid-late", "low-a", "low-b", "low-c"]
    started = [e for e in flat(engine.step()) if isinstance(e, Started)]
    assert [e.request_id for e in started] == ["high", "mid"]


def test_a_failing_step_is_blamed_on_its_forward_and_a_blamed_request_prefills_alone(tiny):
    """A prefill that raises leaves its requests as the suspects (not the decoding ones); a
    request a death was blamed on (attempt > 0) starts in an admission pass of its own, with no
    other prefill beside it."""
    ref, folder = tiny
    engine = make_engine(folder)
    engine.add(req("a", [5, 6, 7], 8))
    engine.step()
    engine.add(req("b", [11, 3], 4))
    engine.add(req("c", [2, 9], 4))

    def failing(*args, **kwargs):
        raise RuntimeError("a poisoned prefill")

    engine.runner.prefill = failing
    with pytest.raises(RuntimeError):
        engine.step()
    assert sorted(r.id for r in engine.suspects()) == ["b", "c"]
    engine = make_engine(folder)
    suspect = req("s", [4, 4], 4)
    suspect = Req(msg=suspect.msg.model_copy(update={"attempt": 1}), inbox_id="9-0")
    for r in (req("x", [1, 2], 4), suspect, req("y", [3, 1], 4)):
        engine.add(r)
    admitted = [[e.request_id for e in events if type(e).__name__ == "Started"] for events in _steps(engine, 3)]
    assert admitted == [["x"], ["s"], ["y"]]  # x first; s alone once x's prefill is done; y after s's


def _steps(engine, n: int) -> list[list]:
    out = []
    for _ in range(n):
        early: list = []
        events = engine.step(early=early.extend)
        out.append(flat([*early, *events]))
    return out
