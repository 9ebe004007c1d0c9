"""The engine on an FP8 model (weights and KV pool in FP8) on the CPU path: what works in full precision
works here. The prefix cache, chunked prefills, pauses and a requeued request give the greedy tokens of
the plain run (FP8 quantises each token's activations and K/V on their own, so none of these changes a
token's arithmetic); prompt log-probabilities come with the first token, near the full-precision
model's; a request moved from an FP8 worker to a full-precision one keeps its tokens so far (its
continuation is the other model's: it may differ from the FP8 run's); constrained output follows its
schema; a tensor-parallel FP8 worker (two processes over gloo) gives the one-process FP8 logits."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.model_files import ModelSource
from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.model_harness import PoolRunner
from tests.worker.test_engine import req, run_to_end, tiny  # noqa: F401 (fixture)
from tests.worker.test_fp8 import reference
from tests.worker.test_grammar import JSON_SCHEMA, SAMPLED, SCHEMA, cache, msg, run, tokenizer  # noqa: F401
from tests.worker.test_grammar import tiny as tiny_vocab  # noqa: F401 (fixture)
from tests.worker.test_prefix_cache_engine import SYSTEM
from tests.worker.test_prompt_logprobs import PROMPT, prompts_of, scoring
from tests.worker.test_prompt_logprobs import reference as prompt_reference
from worker.engine.engine import Engine, EngineLimits
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.fp8 import Fp8Linear
from worker.model.layers import TensorParallel
from worker.model.loader import attach_kv_cache, load_model
from worker.model.quant import FP8
from worker.runner.grammar import Grammars
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable


def make_engine(
    folder,
    cache: bool = False,
    pool: int = 400,
    admission: str = "conservative",
    batch_max_tokens: int = 64,
    fp8: bool = True,
    grammars=None,
    eos: frozenset[int] = frozenset(),
) -> Engine:
    """An engine on the model in ``folder``: FP8 weights and pool (``fp8``), else fp32 both."""
    model, config = load_model(ModelSource("hf", folder), torch.float32, "cpu", quantization="fp8" if fp8 else "none")
    kv = attach_kv_cache(model, pool, "cpu", FP8 if fp8 else None)
    slots = TokenPool(pool)
    runner = ModelRunner(
        model,
        slots,
        ReqTable(8, 256, kv.hold_slot, "cpu"),
        config.vocab_size,
        torch.device("cpu"),
        set(eos),
        prefix_cache=RadixCache(slots) if cache else None,
        grammars=grammars,
    )
    rule = AdmissionRule(AdmissionSettings(admission=admission, history_window=10, history_prior=5))
    return Engine(runner, EngineLimits(pool, batch_max_tokens, 8), eos_ids=set(eos), rule=rule)


def is_fp8(engine: Engine) -> bool:
    model = engine.runner.model
    return model.backend.cache.buffer.dtype == FP8 and any(isinstance(m, Fp8Linear) for m in model.modules())


def test_the_prefix_cache_and_chunked_prefills_give_the_plain_runs_tokens(tiny):  # noqa: F811
    _, folder = tiny

    def arrivals():
        return {
            0: [req("a", SYSTEM + [1, 2, 3], 6)],
            2: [req("b", SYSTEM + [1, 2, 4, 5], 6)],
            12: [req("c", SYSTEM + [1, 2, 3] + [9] * 6, 5), req("d", SYSTEM[:20] + [7], 4)],
        }

    plain = run_to_end(make_engine(folder), arrivals())
    cached = make_engine(folder, cache=True, batch_max_tokens=8)  # prompts in chunks of at most 8 tokens
    assert run_to_end(cached, arrivals()) == plain
    assert cached.runner.slots.num_hit >= 40 + 20  # c and d at least (b may arrive mid-prefill of a)
    assert is_fp8(cached)


def test_pauses_under_a_small_pool_resume_and_match(tiny):  # noqa: F811
    _, folder = tiny

    def arrivals():  # the history says outputs are short (5); these run 30: the pool overflows
        return {0: [req(f"r{i}", SYSTEM[:20] + [3 + i, 7], 30) for i in range(6)]}

    roomy = run_to_end(make_engine(folder, pool=400), arrivals())
    small = make_engine(folder, cache=True, pool=150, admission="past_future")
    small.rule.learn([5] * 10)
    assert run_to_end(small, arrivals()) == roomy
    assert small.num_pauses > 0


def test_a_request_requeued_from_an_fp8_worker_keeps_its_tokens(tiny):  # noqa: F811
    """Its emitted tokens come back as resume_ids: an FP8 worker continues exactly as the first run; a
    full-precision one continues after the same tokens, with its own (possibly different) next ones."""
    _, folder = tiny
    prompt = SYSTEM + [4]
    whole = run_to_end(make_engine(folder), {0: [req("x", prompt, 10)]})["x"]
    resumed = GenerateRequest(
        id="x", prompt_ids=prompt, params=SamplingParams(max_new_tokens=10), created_ms=0, resume_ids=whole[:6]
    )
    assert whole[:6] + run_to_end(make_engine(folder), {0: [Req(msg=resumed, inbox_id="x-1")]})["x"] == whole
    rest = run_to_end(make_engine(folder, fp8=False), {0: [Req(msg=resumed, inbox_id="x-1")]})["x"]
    # the full-precision worker's continuation is its greedy answer to the prompt plus those six tokens
    assert rest == run_to_end(make_engine(folder, fp8=False), {0: [req("y", prompt + whole[:6], 4)]})["y"]


def test_prompt_logprobs_come_once_and_near_full_precision(tiny):  # noqa: F811
    ref, folder = tiny
    engine = make_engine(folder, batch_max_tokens=4)
    found = prompts_of(engine, req("other", [7, 8, 9], 3), scoring("s", 3))
    assert set(found) == {"s"} and len(found["s"]) == len(PROMPT) - 1
    for (logprob, top), (want, _) in zip(found["s"], prompt_reference(ref, 3)):
        assert logprob == pytest.approx(want, abs=0.05) and len(top) == 3


def test_constrained_output_follows_its_schema(tiny_vocab, cache, tokenizer):  # noqa: F811
    engine = make_engine(tiny_vocab, pool=2048, grammars=Grammars(cache), eos=frozenset({2}))
    reqs = [Req(msg=msg(f"j{i}", JSON_SCHEMA, seed=i, **SAMPLED), inbox_id=f"j{i}-0") for i in range(3)]
    tokens, reasons = run(engine, *reqs)
    for key, ids in tokens.items():
        assert reasons[key] == "stop", key
        answer = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        assert set(answer) == set(SCHEMA["required"]) and answer["tag"] in ("a", "b")


# --- tensor parallel -----------------------------------------------------------------------------------

STEPS = [{0: [5, 17, 3, 99, 42, 7], 1: [50], 2: list(range(30, 41))}, {0: [8], 1: [9, 10, 11], 2: [1]}]


def _run(folder: str, tp: TensorParallel) -> list[torch.Tensor]:
    model, _ = load_model(ModelSource("hf", folder), torch.float32, "cpu", tp=tp, quantization="fp8")
    runner = PoolRunner(model)
    return [runner.step(step) for step in STEPS]


def _rank_main(rank: int, init_file: str, folder: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.save(_run(folder, TensorParallel(rank, 2)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_fp8_matches_one_process(tmp_path):
    """Column-split layers keep their rows' scales; row-split ones quantise each rank's slice of the input
    on its own (a scale per rank), so the sum differs from one process's by FP8 rounding, not more."""
    folder = str(tmp_path / "model")
    reference("llama-bias", folder)  # biases on every projection, split and whole
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), folder, str(tmp_path)), nprocs=2, join=True)
    single = _run(folder, TensorParallel())
    for rank in range(2):
        for got, want in zip(torch.load(tmp_path / f"rank{rank}.pt"), single):
            scale = want.abs().max().item()
            torch.testing.assert_close(got, want, atol=0.03 * scale, rtol=0.03)
