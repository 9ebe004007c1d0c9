"""Offline throughput: 1,000 ShareGPT-like requests submitted at once to one engine.

    python bench/engine/offline.py --model-shape llama3-8b [--peer hf] [--json-schema FILE]
                            [--quantization fp8] [--kv-cache-dtype fp8_e4m3]
                            [--lora-adapters 100 --lora-rank 16]

Dummy bf16 weights (N(0, 0.02), never zeros; ``--quantization fp8`` quantises the
linear layers to FP8 at load, ``--kv-cache-dtype fp8_e4m3`` keeps the KV pool in
FP8, the worker's flags of the same names), token-id prompts, ignore_eos
so each request emits exactly its drawn length. The engine is driven
directly (no Redis, no HTTP): this measures kernels, batching and the step
loop. Prints one comparable line per system, and the ratio with ``--peer``.

``--json-schema FILE`` puts that schema on every request (constrained
decoding, ``worker.runner.grammar``), for the cost of the masks. xgrammar
needs token texts, so the engine gets ``--tokenizer`` (the embedded
SmolLM2's by default: a real 49,152-token BPE vocabulary; the ids of a larger
shape past it are never allowed, and a smaller shape, such as ``tiny``, gets
its vocabulary widened to the tokenizer's). ignore_eos still holds outside
the grammar's end, but a grammar-complete output ends (``stop``) before its
drawn length, so the line counts the tokens actually emitted and says how the
requests ended. ``bench/engine/offline_schema.json`` is an array of at least 100,000
objects, which no drawn length completes: every request then runs its drawn
length (``length``), the constrained run emits as many tokens as the plain
one, and the two lines compare.

``--lora-adapters N`` serves N random adapters of ``--lora-rank`` on every attention and MLP
projection (``bench.engine.lora_adapters``, written under ``--lora-dir`` once) and gives each
request one of them, drawn uniformly (seeded): compare with a run without it in the same call.
``--lora-resident M`` registers them at run time instead, at most M on the device (paged in as
requests start, least recently used out), over ``--lora-files`` distinct files (``register_many``):
issue 32's 1,000 adapters with 64 resident is ``--lora-adapters 1000 --lora-files 100 --lora-resident 64``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from bench.engine.lora_adapters import register_many, write_adapters
from bench.engine.shapes import SHAPES, config_dir
from bench.workloads.sharegpt import describe, sharegpt_lengths
from shared.config import ModelSettings
from shared.model_files import load_tokenizer, resolve
from shared.schemas import Constraint, GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from worker.engine.events import Started, Tokens
from worker.engine.request import Req
from worker.main import build_engine, follower, rank_device
from worker.runner import tp as tensor_parallel


def workload(args) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    vocab = SHAPES[args.model_shape]["vocab_size"]
    return [(rng.integers(3, vocab, size=i).tolist(), o) for i, o in sharegpt_lengths(args.num_requests, args.seed)]


@dataclass
class Tally:
    """What a run emitted: output tokens, how the requests ended, and (``keep_ids``) each output."""

    tokens: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    keep_ids: bool = False
    output_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, events) -> int:
        """Count one step's events; the number of tokens they carry."""
        count = 0
        for event in events:
            if isinstance(event, Tokens):
                count += len(event)
                self.reasons.update(event.reasons.values())
                if self.keep_ids:
                    for request_id, token_id in zip(event.request_ids, event.token_ids):
                        self.output_ids.setdefault(request_id, []).append(token_id)
        self.tokens += count
        return count


def constraint_from(args) -> Constraint | None:
    if args.json_schema is None:
        return None
    with open(args.json_schema) as f:
        return Constraint(kind="json_schema", spec=f.read())


def page_in_by(adapters, way: str) -> None:
    """--lora-page-in: 'ahead' as the worker does (worker.lora.staging), 'staged' without the copies
    ahead, 'copies' piece by piece as before the staging (the comparison's arms)."""
    if way == "copies":
        adapters.staging = None
    elif way == "staged":
        adapters.staging.ahead.clear()
        adapters.staging.free.clear()


def run_lightq(args, work, tally: Tally) -> float:
    constraint = constraint_from(args)
    tokenizer = load_tokenizer(resolve(args.tokenizer)) if constraint is not None else None  # for the grammar
    # the grammar's tokenizer must fit the logits: a smaller shape's vocabulary is widened to it
    vocab = args.vocab_size or SHAPES[args.model_shape]["vocab_size"]
    vocab = max(vocab, len(tokenizer)) if tokenizer is not None else vocab
    # --lora-resident M: the adapters are registered at run time (slots: a cache of M), over
    # --lora-files distinct files; else each is one of --lora_modules', all on the device
    files = (args.lora_files or args.lora_adapters) if args.lora_resident else args.lora_adapters
    loras = write_adapters(args.model_shape, files, args.lora_rank, Path(args.lora_dir))
    settings = WorkerSettings(
        model=ModelSettings(
            model_dir=f"dummy:{config_dir(args.model_shape, vocab_size=vocab)}",
            max_req_total_len=2048,
            lora_modules=[] if args.lora_resident else loras,
            max_lora_rank=args.lora_rank,
        ),
        max_loras=args.lora_resident,
        lora_page_batch=args.lora_page_batch,
        lora_prefetch=args.lora_prefetch,
        device=args.device,
        max_total_token_num=args.max_total_token_num,
        batch_max_tokens=args.batch_max_tokens,
        running_max_req_size=args.running_max,
        graph_max_batch_size=args.graph_max_bs,
        cuda_graphs=not args.no_graphs,
        tp=args.tp,
        overlap=args.overlap,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    # --tp N: N - 1 follower processes, as `lightq worker --tp N` starts them (worker.main.run)
    group = tensor_parallel.launch(args.tp, rank_device(settings, 0), follower, settings) if args.tp > 1 else None
    try:
        engine = build_engine(settings, tokenizer, group=group)
        assert constraint is None or engine.runner.grammars is not None  # the vocabulary fits the tokenizer
        print(
            f"lightq: KV pool {engine.limits.max_total_tokens} tokens, graphs {engine.runner.graphs is not None},"
            f" tp {args.tp}, vocabulary {vocab:,}, constraint {args.json_schema},"
            f" quantization {args.quantization}, KV {args.kv_cache_dtype}, LoRA adapters {args.lora_adapters}"
        )
        names = [spec.split("=", 1)[0] for spec in loras]
        if args.lora_resident:
            runner = engine.runner
            names = register_many(runner.adapters, runner.model, loras, args.lora_adapters, args.lora_rank)
            print(f"LoRA: {len(names)} adapters over {len(loras)} files, at most {args.lora_resident} resident")
        warm = [(ids[:16], 4) for ids, _ in work[:8]]
        # the grammar and the LoRA kernels compile here, once
        drive(engine, warm, progress=False, constraint=constraint, adapters=names)
        if engine.runner.adapters is not None and engine.runner.adapters.staging is not None:
            page_in_by(engine.runner.adapters, args.lora_page_in)
        timeline: list[tuple[float, int, bool]] | None = [] if args.timeline else None
        seconds = drive(
            engine, work, progress=True, timeline=timeline, constraint=constraint, tally=tally, adapters=names,
            profiles=PrefillProfiles(args.profile_prefills),
        )  # fmt: skip
        if args.lora_resident:
            lora, staging = engine.runner.adapters, engine.runner.adapters.staging
            ahead = "" if staging is None else f", {staging.used} of them copied ahead ({staging.prefetched} copies)"
            print(f"LoRA: {lora.loads} adapters paged in (warm-up's included){ahead}")
    finally:
        if group is not None:
            group.close()
    if timeline:
        print_timeline(timeline)
    return seconds


def drive(
    engine,
    work,
    progress: bool,
    timeline: list | None = None,
    constraint: Constraint | None = None,
    tally: Tally | None = None,
    adapters: list[str] | None = None,
    profiles: PrefillProfiles | None = None,
) -> float:
    """Run ``work`` to the end, every request under ``constraint`` and with one of ``adapters``
    (uniform, seeded; none: the base model); ``timeline`` gets (seconds, decoding requests,
    prefilled too) per step, ``tally`` what was emitted; ``profiles``: steps that start requests
    run under the torch profiler."""
    profiles = profiles if profiles is not None else PrefillProfiles(0)
    tally = tally if tally is not None else Tally()
    draw = np.random.default_rng(1)
    for i, (ids, out) in enumerate(work):
        params = SamplingParams(max_new_tokens=out, ignore_eos=True, constraint=constraint)
        adapter = adapters[draw.integers(len(adapters))] if adapters else None
        msg = GenerateRequest(id=f"r{i}", prompt_ids=ids, created_ms=0, params=params, adapter=adapter)
        engine.add(Req(msg=msg, inbox_id=f"{i}-0"))
    bar = tqdm(total=sum(o for _, o in work), unit="tok", disable=not progress, mininterval=2)
    sync()
    start = time.perf_counter()
    while engine.has_work:
        if timeline is not None:
            decoding = sum(r.is_prefilled for r in engine.running)
            chunking = decoding < len(engine.running)  # a prefill under way goes on
            began = time.perf_counter()
        events = profiles.step(engine) if profiles.wanted(engine) else engine.step()
        bar.update(tally.add(events))
        if timeline is not None:
            # a prefill step: one went on, or one began (a request started); requests merely waiting
            # (for an adapter slot, say) leave it a decode step
            started = any(isinstance(event, Started) for event in events)
            timeline.append((time.perf_counter() - began, decoding, chunking or started))
    sync()
    bar.close()
    profiles.report()
    return time.perf_counter() - start


class PrefillProfiles:
    """Steps that may start requests (some wait), profiled (CPU and CUDA) once past the first
    ``after``; those that did start one are kept, until ``count``. A profiled step is slower than a
    plain one (its timeline entry too): the kernels' GPU time and the host's calls are what it is for."""

    def __init__(self, count: int, after: int = 50):
        self.count, self.after, self.steps = count, after, 0
        self.kept: list = []  # (wall seconds, requests started, the profiler)

    def wanted(self, engine) -> bool:
        self.steps += 1
        return len(self.kept) < self.count and self.steps > self.after and bool(engine.waiting)

    def step(self, engine) -> list:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        began = time.perf_counter()
        with profile(activities=acts) as prof:
            events = engine.step()
            sync()
        if any(isinstance(event, Started) for event in events):
            self.kept.append((time.perf_counter() - began, sum(isinstance(e, Started) for e in events), prof))
        return events

    def report(self) -> None:
        for i, (seconds, started, prof) in enumerate(self.kept):
            averages = prof.key_averages()
            gpu = sum(a.self_device_time_total for a in averages) / 1e3
            print(f"\nprofiled prefill step {i}: {started} requests started, {seconds * 1e3:.1f} ms wall "
                  f"(profiled), {gpu:.1f} ms of GPU kernels")  # fmt: skip
            if i == 0:
                sort = "cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
                print(averages.table(sort_by=sort, row_limit=22, max_name_column_width=60))
                print(averages.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))


def print_timeline(timeline: list[tuple[float, int, bool]]) -> None:
    """Where the wall time went: steps that prefilled, then decode-only steps by batch size."""
    print(f"{'steps':<22} {'count':>6} {'seconds':>8} {'ms/step':>8} {'mean batch':>10}")
    bands = [("with prefill", lambda d, p: p)] + [
        (f"decode, batch {lo}-{hi - 1}", lambda d, p, lo=lo, hi=hi: not p and lo <= d < hi)
        for lo, hi in ((1, 16), (16, 64), (64, 256), (256, 512), (512, 100_000))
    ]
    for name, member in bands:
        rows = [(t, d) for t, d, p in timeline if member(d, p)]
        if rows:
            total = sum(t for t, _ in rows)
            print(
                f"{name:<22} {len(rows):>6} {total:>8.2f} {total / len(rows) * 1e3:>8.2f} "
                f"{sum(d for _, d in rows) / len(rows):>10.0f}"
            )


def run_hf_peer(args, work) -> float:
    """transformers' own continuous batching on the same GPU and workload (paged|sdpa)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[args.model_shape])
    with torch.device(args.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.config._attn_implementation = "sdpa"
    gen = GenerationConfig(max_new_tokens=2048, do_sample=False, eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_batch_tokens=args.batch_max_tokens, use_cuda_graph=False)
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb) as m:
        for ids, out in work:
            m.add_request(ids, max_new_tokens=out)
        for _ in tqdm(range(len(work)), unit="req", mininterval=5):
            m.get_result(timeout=3600)
    return time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def report(name: str, work, seconds: float, tally: Tally | None = None) -> float:
    """The one line; output tokens as counted (``tally``), else the drawn lengths (the peer's)."""
    out = tally.tokens if tally is not None else sum(o for _, o in work)
    total = out + sum(len(i) for i, _ in work)
    ended = f", ended {dict(sorted(tally.reasons.items()))}" if tally is not None else ""
    print(
        f"{name}: {len(work)} requests in {seconds:.2f} s: {len(work) / seconds:.2f} req/s, "
        f"{out / seconds:,.0f} output tok/s, {total / seconds:,.0f} total tok/s{ended}"
    )
    return out / seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-total-token-num", type=int, default=None)
    parser.add_argument("--batch-max-tokens", type=int, default=8192)
    parser.add_argument("--running-max", type=int, default=1024)
    parser.add_argument("--graph-max-bs", type=int, default=1024)
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (one process each)")
    parser.add_argument("--timeline", action="store_true", help="print where the wall time went, by step kind")
    parser.add_argument(
        "--overlap", choices=["auto", "on", "off"], default="auto", help="the worker's --overlap (auto: on a GPU)"
    )
    parser.add_argument(
        "--quantization", choices=["none", "fp8", "fp8_w8a16"], default="none", help="the worker's --quantization"
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto", help="the worker's --kv_cache_dtype"
    )
    parser.add_argument(
        "--profile-prefills", type=int, default=0, help="profile this many steps that start requests (slows the run)"
    )
    parser.add_argument("--peer", choices=["hf"], default=None)
    parser.add_argument("--json-schema", default=None, metavar="FILE", help="every request follows this schema")
    parser.add_argument("--tokenizer", default="default", help="--json-schema's tokenizer (a lightq --model_dir)")
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="replaces the shape's (a plain run to compare with a widened one)"
    )
    parser.add_argument("--lora-adapters", type=int, default=0, help="serve this many random LoRA adapters")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--lora-dir", default="/tmp/lightq-bench-lora", help="where the adapters are written, once")
    parser.add_argument(
        "--lora-resident",
        type=int,
        default=0,
        help="register the adapters at run time, at most this many on the device",
    )
    parser.add_argument("--lora-files", type=int, default=0, help="with --lora-resident: distinct files (0: one each)")
    parser.add_argument("--lora-page-batch", type=int, default=8, help="the worker's --lora_page_batch")
    parser.add_argument("--lora-prefetch", type=int, default=0, help="the worker's --lora_prefetch")
    parser.add_argument(
        "--lora-page-in", choices=("ahead", "staged", "copies"), default="ahead", help=page_in_by.__doc__
    )
    args = parser.parse_args(argv)
    if args.peer is not None and (args.json_schema is not None or args.vocab_size is not None):
        parser.error("--peer runs the shape as it is: compare --json-schema with a run of lightq alone")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = workload(args)
    print(f"workload: input {describe([len(i) for i, _ in work])}; output {describe([o for _, o in work])}")
    tally = Tally()
    seconds = run_lightq(args, work, tally)
    name = f"lightq {args.model_shape}" + (" json-schema" if args.json_schema else "")
    name += {"fp8": " fp8", "fp8_w8a16": " fp8-w8a16"}.get(args.quantization, "")
    name += " fp8-kv" if args.kv_cache_dtype == "fp8_e4m3" else ""
    name += f" lora {args.lora_adapters}x r{args.lora_rank}" if args.lora_adapters else ""
    name += f" resident {args.lora_resident}" if args.lora_resident else ""
    name += f" prefetch {args.lora_prefetch}" if args.lora_prefetch else ""
    ours = report(name, work, seconds, tally)
    if args.peer == "hf":
        gc.collect()  # the engine (weights, KV pool, graphs) must be gone before the peer loads
        torch.cuda.empty_cache()
        theirs = report(f"transformers-cb {args.model_shape}", work, run_hf_peer(args, work))
        print(f"ratio lightq / transformers: {ours / theirs:.1f}x")


if __name__ == "__main__":
    main()
