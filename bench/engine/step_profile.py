"""Where a decode step's time goes, through the real engine (issue 3's profile).

    python -m bench.engine.step_profile --model-shape llama3-8b --batches 1,64,256,1024

For each batch size B: B requests with ``--context`` prompt tokens are
prefilled, then ``--steps`` decode steps of ``Engine.step()`` are timed on
the host clock (the step ends with the sampled ids on the host, so its wall
time is the real cost of a token for the whole batch). CUDA events split the
step into the model's forward (the CUDA graph), sampling, and the host's own
work between them (engine bookkeeping, batch building: nothing on the GPU).
Those split steps run without overlap (``Engine.overlap`` off: each step waits for its tokens);
the "overlapped" column is the mean of ``--steps`` back-to-back steps with it on, where the host
prepares a step while the GPU runs the last (only the end is waited for): the step time a
serving worker gets (``--overlap auto`` on a GPU). With ``--arrival N``, steps that each take in
a new request of N prompt tokens are timed too (a prefill forward, then the decode one); "prefill" is
the prefill forward's time. With ``--trace B`` a torch profiler table of the kernels of one eager
forward at batch B follows (kernel times are the graph's; eager only adds
launch gaps), grouped by kernel name, so the largest costs read off the top.

With ``--lora-adapters N`` (issue 32), request i runs with adapter i mod N, each a random adapter of
``--lora-rank`` on every projection and a device slot of its own, registered at run time over
``--lora-files`` files as the offline bench's 1,000-adapter run does: ``--lora-adapters 64 --batches
77`` is that run's slot-bound decode step (64 adapters, ~77 requests), to set against the same batch
without adapters from a run without the flag.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.engine.lora_adapters import register_many, write_adapters
from bench.engine.offline import sync
from bench.engine.shapes import SHAPES, config_dir
from shared.config import ModelSettings
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from worker.engine.request import Req
from worker.main import build_engine


class Timed:
    """Wraps a callable: CUDA events around each call, read after the step."""

    def __init__(self, fn):
        self.fn, self.pairs, self.cpu_ms, self.kinds = fn, [], 0.0, []

    def __call__(self, *args, **kwargs):
        self.kinds.append(getattr(args[0], "is_decode", None) if args else None)
        if not torch.cuda.is_available():  # a CPU smoke run: the host clock
            start = time.perf_counter()
            out = self.fn(*args, **kwargs)
            self.cpu_ms += (time.perf_counter() - start) * 1e3
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.fn(*args, **kwargs)
        end.record()
        self.pairs.append((start, end))
        return out

    def take_ms(self) -> float:
        return sum(ms for _, ms in self.take_each_ms())

    def take_each_ms(self) -> list[tuple[bool | None, float]]:
        """(is_decode, ms) of each call since the last take (on CPU: their sum, as one call)."""
        sync()
        if self.cpu_ms:
            each = [(self.kinds[0] if len(self.kinds) == 1 else None, self.cpu_ms)]
        else:
            each = list(zip(self.kinds, (s.elapsed_time(e) for s, e in self.pairs)))
        self.pairs, self.cpu_ms, self.kinds = [], 0.0, []
        return each


def fill(engine, batch: int, context: int, vocab: int, rng, steps: int, adapters: list[str] = ()) -> list[Req]:
    """B requests prefilled and decoding; ``steps`` new tokens each, so all of them fit the pool at once.
    ``adapters``: request i runs with adapter i mod their number (none: the base model)."""
    reqs = []
    for i in range(batch):
        msg = GenerateRequest(
            id=f"b{batch}-{i}",
            prompt_ids=rng.integers(3, vocab, size=context).tolist(),
            created_ms=0,
            params=SamplingParams(max_new_tokens=steps, ignore_eos=True),
            adapter=adapters[i % len(adapters)] if adapters else None,
        )
        reqs.append(Req(msg=msg, inbox_id=f"{i}-0"))
        engine.add(reqs[-1])
    while engine.waiting or not all(r.is_prefilled for r in engine.running):
        engine.step()
    return reqs


def measure(engine, steps: int, arrival: list[int] | None = None) -> dict[str, float]:
    """Median step times; with ``arrival`` (prompt ids), a new request joins before every step,
    as in serving at a steady rate: its prefill runs as the step's first forward."""
    runner = engine.runner
    forward, sample = Timed(runner.forward), Timed(runner._sample)
    runner.forward, runner._sample = forward, sample
    walls, fwd, prefill, smp, joined = [], [], [], [], []
    try:
        for i in range(steps):
            if arrival is not None:
                msg = GenerateRequest(
                    id=f"arrival-{len(arrival)}-{i}",
                    prompt_ids=arrival,
                    created_ms=0,
                    params=SamplingParams(max_new_tokens=steps + 10, ignore_eos=True),
                )
                joined.append(Req(msg=msg, inbox_id=f"{i}-1"))
                engine.add(joined[-1])
            sync()
            start = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - start) * 1e3)
            each = forward.take_each_ms()  # the prefill's forward, the decode graph's
            fwd.append(sum(ms for is_decode, ms in each if is_decode is not False))
            prefill.append(sum(ms for is_decode, ms in each if is_decode is False))
            smp.append(sample.take_ms())
    finally:
        del runner.forward, runner._sample  # back to the class's methods
        for req in joined:
            engine.cancel(req)
    wall, f, p, s = (statistics.median(x) for x in (walls, fwd, prefill, smp))
    return {"wall": wall, "forward": f, "prefill": p, "sample": s, "host": wall - f - p - s}


def measure_overlapped(engine, steps: int) -> float:
    """Mean ms of ``steps`` back-to-back overlapped decode steps (the last one's tokens landed too)."""
    engine.overlap = True
    try:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine.flush()
        sync()
    finally:
        engine.overlap = False
    return (time.perf_counter() - start) * 1e3 / steps


def trace(engine, batch: int) -> None:
    """Kernel table of one eager decode forward at ``batch`` (the requests are running)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        for _ in range(3):
            engine.step()
        with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
            engine.step()
            sync()
    finally:
        engine.runner.graphs = graphs
    print(f"\nkernels of one eager decode step at batch {batch} (GPU time):")
    sort_by = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort_by, row_limit=18, max_name_column_width=70))


def trace_arrival(engine, prompt: list[int]) -> None:
    """Host-side table of one step that prefills a new request beside the running batch: where
    the host's time goes in the eager prefill forward (a small prefill waits on the host)."""
    joined = []
    for i in range(4):  # the last one is profiled
        msg = GenerateRequest(
            id=f"traced-{i}", prompt_ids=prompt, created_ms=0, params=SamplingParams(max_new_tokens=8, ignore_eos=True)
        )
        joined.append(Req(msg=msg, inbox_id=f"{i}-2"))
        engine.add(joined[-1])
        if i < 3:
            engine.step()
    profiler = cProfile.Profile()
    profiler.enable()
    engine.step()
    sync()
    profiler.disable()
    for req in joined:
        engine.cancel(req)
    print(f"\nhost time of one step with a {len(prompt)}-token arrival, by Python function (cProfile):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,64,256,1024")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--trace",
        default="",
        help="batch sizes to show a kernel table for, e.g. 64,1024 "
        "(with --arrival, also the host ops of a step with an arrival)",
    )
    parser.add_argument(
        "--arrival",
        type=int,
        default=0,
        help="also time steps that each take in a new request of this many prompt tokens",
    )
    parser.add_argument(
        "--quantization", choices=["none", "fp8", "fp8_w8a16"], default="none", help="the worker's --quantization"
    )
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument("--lora-adapters", type=int, default=0, help="request i runs with adapter i mod this")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-files", type=int, default=8, help="distinct adapter files the names share")
    parser.add_argument("--lora-dir", default="/tmp/lightq-bench-lora", help="where the adapters are written, once")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    traced = {int(b) for b in args.trace.split(",") if b}
    room = args.steps + 8 if args.arrival else 0  # arrivals join the running batch, one a step
    settings = WorkerSettings(
        model=ModelSettings(
            model_dir=f"dummy:{config_dir(args.model_shape)}", max_req_total_len=2048, max_lora_rank=args.lora_rank
        ),
        max_loras=args.lora_adapters,
        device=args.device,
        batch_max_tokens=8192,
        overlap="off",  # the split steps; measure_overlapped turns it on for its own
        running_max_req_size=max(batches) + room,
        graph_max_batch_size=max(batches) + room,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = build_engine(settings)
    names: list[str] = []
    if args.lora_adapters:  # every name its own slot, all of them resident (paged in as requests start)
        files = write_adapters(
            args.model_shape, min(args.lora_files, args.lora_adapters), args.lora_rank, Path(args.lora_dir)
        )
        names = register_many(engine.runner.adapters, engine.runner.model, files, args.lora_adapters, args.lora_rank)
    vocab, rng = SHAPES[args.model_shape]["vocab_size"], np.random.default_rng(0)
    rows = []
    for b in batches:
        # Enough tokens that none ends while timed: the first admitted decode through the fill's prefill steps too.
        fill_steps = b * args.context // settings.batch_max_tokens + 1
        reqs = fill(engine, b, args.context, vocab, rng, fill_steps + 3 * args.steps + 10, names)
        rows.append((b, 0, measure(engine, args.steps)))
        rows[-1][2]["overlapped"] = measure_overlapped(engine, args.steps)
        if args.arrival:  # steps that each take in a new request: its prefill, then the decode
            prompt = rng.integers(3, vocab, size=args.arrival).tolist()
            rows.append((b, str(args.arrival), measure(engine, args.steps, prompt)))
        if b in traced:
            trace(engine, b)
            if args.arrival:
                trace_arrival(engine, rng.integers(3, vocab, size=args.arrival).tolist())
        for req in reqs:
            engine.cancel(req)
    lora = f", {args.lora_adapters} LoRA adapters of rank {args.lora_rank}" if args.lora_adapters else ""
    print(f"\n{args.model_shape}, context {args.context}{lora}, median of {args.steps} engine steps (ms)")
    print(
        f"{'batch':>5} {'arrival':>11} {'step':>8} {'decode':>8} {'prefill':>8} {'sample':>8} {'host':>8} {'tok/s':>9}"
        f" {'overlapped':>10} {'tok/s':>9}"
    )
    for b, arrival, m in rows:
        overlapped = f" {m['overlapped']:>10.2f} {b / m['overlapped'] * 1e3:>9,.0f}" if "overlapped" in m else ""
        print(
            f"{b:>5} {arrival:>11} {m['wall']:>8.2f} {m['forward']:>8.2f} {m['prefill']:>8.2f} {m['sample']:>8.2f} "
            f"{m['host']:>8.2f} {b / m['wall'] * 1e3:>9,.0f}{overlapped}"
        )
    return {b: m for b, arrival, m in rows if not arrival}


if __name__ == "__main__":
    main()
