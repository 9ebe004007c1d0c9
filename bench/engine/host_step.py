"""The engine's host-side cost of one decode step, with a model that costs nothing.

    .venv/bin/python -m bench.engine.host_step                 # batches 64, 256, 1024
    .venv/bin/python -m bench.engine.host_step --batches 1024 --profile
    .venv/bin/python -m bench.engine.host_step --burst 1000        # one admission pass over 1,000 requests

The counting model (``worker.model.counting_model``) answers each step with one
[B, V] logits tensor and no attention, so what a step costs here is the
engine's own work: admission, the request table and slots, building the
sampling batch, sampling, events and finish checks. On a GPU that work runs
on the host between kernel launches and is not overlapped with them, so it
adds to every step (a Llama-3-8B decode step at batch 256 takes 12.7 ms on an
H200, bench/RESULTS.md). One thread, V = 256, prompts of 16 tokens, every
request decoding (``ignore_eos``, 500 new tokens); median of ``--steps``
steps after 5 warm-up steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from shared.admission import AdmissionRule
from shared.config import AdmissionSettings
from shared.schemas import GenerateRequest, SamplingParams
from worker.engine.engine import Engine, EngineLimits
from worker.engine.request import Req
from worker.engine.token_pool import TokenPool
from worker.model.counting_model import CountingModel
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

VOCAB, PROMPT, NEW = 256, 16, 500


def engine_with(batch: int) -> Engine:
    device = torch.device("cpu")
    slots = batch * (PROMPT + NEW + 8)
    table = ReqTable(batch, PROMPT + NEW + 8, slots, device)
    runner = ModelRunner(CountingModel(VOCAB, device), TokenPool(slots), table, VOCAB, device, set(), None)
    engine = Engine(
        runner, EngineLimits(slots, 1 << 20, batch), set(), AdmissionRule(AdmissionSettings(admission="conservative"))
    )
    for i in range(batch):
        msg = GenerateRequest(
            id=f"r{i}",
            prompt_ids=[1 + i % 200] * PROMPT,
            created_ms=0,
            params=SamplingParams(max_new_tokens=NEW, ignore_eos=True),
        )
        engine.add(Req(msg=msg, inbox_id=f"{i}-0"))
    return engine


def measure(batch: int, steps: int, profile: bool) -> float:
    engine = engine_with(batch)
    for _ in range(5):  # admission and prefill, then steady decoding
        engine.step()
    profiler = cProfile.Profile() if profile else None
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        engine.step()
        if profiler:
            profiler.disable()
        times.append(time.perf_counter() - started)
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(20)
    return statistics.median(times) * 1000


def admission_pass(burst: int, policy: str) -> float:
    """Seconds of the one step that admits ``burst`` ShareGPT-like requests at once (all fit)."""
    from bench.workloads.sharegpt import sharegpt_lengths

    device, slots = torch.device("cpu"), burst * 2048
    table = ReqTable(burst, 2048, slots, device)
    runner = ModelRunner(CountingModel(VOCAB, device), TokenPool(slots), table, VOCAB, device, set(), None)
    engine = Engine(
        runner, EngineLimits(slots, 1 << 30, burst), set(), AdmissionRule(AdmissionSettings(admission=policy))
    )
    for i, (prompt, output) in enumerate(sharegpt_lengths(burst, 0)):
        engine.add(
            Req(
                msg=GenerateRequest(
                    id=f"r{i}",
                    prompt_ids=[5] * prompt,
                    created_ms=0,
                    params=SamplingParams(max_new_tokens=output, ignore_eos=True),
                ),
                inbox_id=f"{i}-0",
            )
        )
    started = time.perf_counter()
    admitted = engine._admit()
    seconds = time.perf_counter() - started
    assert len(admitted) == burst, f"{len(admitted)} of {burst} admitted"
    return seconds


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the measured steps")
    parser.add_argument("--burst", type=int, default=0, help="instead: time admitting this many requests at once")
    parser.add_argument("--admission", default="past_future", help="the policy --burst admits under")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.burst:
        seconds = admission_pass(args.burst, args.admission)
        print(f"host_step burst={args.burst} admission={args.admission}: {seconds:.3f} s to admit them all")
        return {args.burst: seconds * 1000}
    results = {batch: measure(batch, args.steps, args.profile) for batch in args.batches}
    for batch, ms in results.items():
        print(f"host_step batch={batch}: {ms:.2f} ms per decode step ({ms * 1000 / batch:.1f} us per request)")
    return results


if __name__ == "__main__":
    main()
