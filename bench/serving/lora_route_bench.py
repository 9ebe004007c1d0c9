"""Adapter-aware routing against load-only routing on a Zipf mix of LoRA adapters (issue 32's goal:
"four workers on one GPU, 200 adapters: adapter-aware routing loads at most half as many adapters
per request as load-only routing, and median TTFT is no worse").

    # on a CPU (the tiny shape: the routing and the slots, not the kernels); nice'd beside other work
    nice -n 5 .venv/bin/python -m bench.serving.lora_route_bench --deadline-s 420
    # four workers sharing one GPU: SmolLM2's shape, random weights (bench/device/h200.sh lora-route: carry .whl .tok)
    python3 -m bench.serving.lora_route_bench --config-dir .tok/smollm2 --requests 2000 --request-rate 40 \\
        --prompt-len 512 --max-tokens 64 --rank 16 --max-loras 16 --deadline-s 560 --out /tmp/lora_route

Per arm, a fresh ``lightq serve --workers N`` (its own embedded Redis; workers on one GPU share it,
``lightq.launcher``) on ``dummy:`` weights of ``--shape``, with ``--max_loras`` device slots a worker
(small, so eviction matters); ``--adapters`` random PEFT adapters (``bench.engine.lora_adapters``)
loaded at run time through ``POST /v1/load_lora_adapter`` (every worker keeps them all in host
memory, pages one into a slot when a request needs it, least recently used out). Then the same
requests in both arms: Poisson arrivals at ``--request-rate``, each naming an adapter drawn from a
Zipf law (``p(k) ~ 1 / k**a``, ``--zipf-a``) in OpenAI's ``model``, streamed, TTFT at the first
token. Adapter loads are the workers' ``worker_lora_loads_total`` over their ``--metrics_port``
endpoints, after the run less before it (the registration's own loads do not count).

Arms: ``aware``, the default routing (a worker holding the adapter wins, traded against load:
``router.admission.views.ADAPTER_HIT``), and ``least``, ``--no-cache_aware``: the switch that turns the
adapter hit off with the prefix hit (an adapter's prompt is never prefix-cached, so on this workload
it is load-only routing). Every stage is bounded by ``--deadline-s`` in all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.serving.route_bench import Clock, stop, verdict
from bench.workloads.lora_mix import lru_bound, workload

ARMS = {"aware": ("adapter-aware", []), "least": ("load-only", ["--no-cache_aware"])}
LOADS = "lightq:worker_lora_loads_total"


@dataclass
class Arm:
    name: str
    loads: float = 0.0  # adapter slot loads during the workload, over the workers
    ttfts: list[float] = field(default_factory=list)  # seconds, successful requests
    errors: list[str] = field(default_factory=list)
    decisions: dict[str, float] = field(default_factory=dict)
    served: dict[str, float] = field(default_factory=dict)  # worker -> requests it ended (the spread)

    @property
    def loads_per_request(self) -> float | None:
        return self.loads / len(self.ttfts) if self.ttfts else None

    @property
    def median_ttft_ms(self) -> float | None:
        return 1000 * statistics.median(self.ttfts) if self.ttfts else None


def model_dir(args: argparse.Namespace) -> str:
    """``dummy:`` a folder with a config.json and a tokenizer: ``--config-dir``, else the shape's."""
    if args.config_dir:
        return f"dummy:{args.config_dir}"
    from bench.engine.shapes import config_dir

    return f"dummy:{config_dir(args.shape, os.path.join(args.out, f'model-{args.shape}'), tokenizer=True)}"


def adapter_specs(args: argparse.Namespace, folder: str) -> list[str]:
    """The adapters' NAME=PATH, written for the model in ``folder`` (its config's sizes)."""
    from bench.engine.lora_adapters import write_adapters
    from bench.engine.shapes import SHAPES

    config = json.loads((Path(folder) / "config.json").read_text())
    shape = f"config-{config['hidden_size']}x{config['num_hidden_layers']}"
    SHAPES.setdefault(
        shape, {k: v for k, v in config.items() if k.endswith(("_size", "_layers", "_heads", "head_dim"))}
    )
    return write_adapters(shape, args.adapters, args.rank, Path(args.out) / "adapters")


def start(args: argparse.Namespace, arm: str, folder: str, clock: Clock) -> subprocess.Popen[bytes] | None:
    command = [
        sys.executable, "-m", "lightq.cli", "serve", "--port", str(args.port), "--workers", str(args.workers),
        "--metrics_port", str(args.metrics_port), "--data_dir", tempfile.mkdtemp(prefix="lora_route-"),
        "--model_dir", folder, "--max_loras", str(args.max_loras), "--max_lora_rank", str(args.rank),
        "--lora_wait_s", "30", *shlex.split(args.serve_args), *ARMS[arm][1],
    ]  # fmt: skip
    log_path = os.path.join(args.out, f"serve_{arm}.log")
    process = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    started = time.monotonic()
    while clock.left(args.start_timeout_s) > 0 and time.monotonic() - started < args.start_timeout_s:
        if "lightq ready" in open(log_path).read():
            print(f"{arm}: up after {time.monotonic() - started:.0f} s", flush=True)
            return process
        if process.poll() is not None:
            break
        time.sleep(1)
    print(f"{arm}: not ready (exit code {process.poll()}); its log's end:\n{open(log_path).read()[-2000:]}")
    stop(process)
    return None


async def register(client: httpx.AsyncClient, specs: list[str]) -> None:
    """Every adapter through the API, 16 at a time (each answer waits for a worker to list it)."""
    gate = asyncio.Semaphore(16)

    async def one(spec: str) -> None:
        name, path = spec.split("=", 1)
        async with gate:
            reply = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        if reply.status_code != 200:
            raise RuntimeError(f"loading {name}: HTTP {reply.status_code} {reply.text[:300]}")

    await asyncio.gather(*(one(spec) for spec in specs))


async def send(
    client: httpx.AsyncClient, at: float, adapter: str, prompt: list[int], args: argparse.Namespace, arm: Arm
) -> None:
    """One streamed completion, sent ``at`` (on the monotonic clock); its TTFT into ``arm``."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    body = {"model": adapter, "prompt": prompt, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                arm.errors.append(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
                return
            ttft = None
            async for line in reply.aiter_lines():  # to the end: the request runs its course
                if '"error"' in line:
                    arm.errors.append(line[:200])
                    return
                if ttft is None and line.startswith("data:") and '"choices"' in line:
                    ttft = time.perf_counter() - sent
            if ttft is not None:
                arm.ttfts.append(ttft)
    except httpx.HTTPError as exc:
        arm.errors.append(repr(exc))


async def drive(args: argparse.Namespace, specs: list[str], arm: Arm, clock: Clock) -> None:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    url = f"http://127.0.0.1:{args.port}"
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout_s, limits=limits) as client:
        started = time.monotonic()
        await asyncio.wait_for(register(client, specs), clock.left(300))
        await asyncio.sleep(2)  # every worker's reconcile (each answer waited for one worker only)
        print(f"{arm.name}: {len(specs)} adapters loaded in {time.monotonic() - started:.0f} s", flush=True)
        before = scrape(args, arm)
        t0 = time.monotonic()
        sends = [send(client, t0 + at, name, prompt, args, arm) for at, name, prompt in workload(args)]
        await asyncio.wait_for(asyncio.gather(*sends), clock.left(args.bench_timeout_s))
    arm.loads = scrape(args, arm) - before


def scrape(args: argparse.Namespace, arm: Arm) -> float:
    """The workers' adapter loads so far (and the router's decisions and the requests each worker
    ended into ``arm``, replaced)."""
    loads, arm.decisions, arm.served = 0.0, {}, {}
    for port in range(args.metrics_port, args.metrics_port + args.workers + 4):
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        for sample in (s for family in text_string_to_metric_families(body) for s in family.samples):
            if sample.name == LOADS:
                loads += sample.value
            elif sample.name == "lightq:router_decisions_total":
                reason = sample.labels["reason"]
                arm.decisions[reason] = arm.decisions.get(reason, 0) + sample.value
            elif sample.name == "lightq:worker_requests_ended_total":
                worker = sample.labels["worker"]
                arm.served[worker] = arm.served.get(worker, 0) + sample.value
    return loads


def run_arm(args: argparse.Namespace, key: str, folder: str, specs: list[str], clock: Clock) -> Arm:
    arm = Arm(ARMS[key][0])
    process = start(args, key, folder, clock)
    if process is None:
        return arm
    try:
        asyncio.run(drive(args, specs, arm, clock))
    except (TimeoutError, RuntimeError, httpx.HTTPError) as exc:
        print(f"{arm.name}: stopped early: {exc!r}")
    finally:
        stop(process)
    decisions = ", ".join(f"{reason} {n:.0f}" for reason, n in sorted(arm.decisions.items()))
    print(f"{arm.name}: {len(arm.ttfts)} requests, {len(arm.errors)} failed {arm.errors[:2]}; "
          f"{arm.loads:.0f} adapter loads; router decisions: {decisions or '-'}; requests a worker: "
          f"{'/'.join(f'{n:.0f}' for n in sorted(arm.served.values(), reverse=True))}", flush=True)  # fmt: skip
    return arm


def compare(arms: dict[str, Arm], bounds: tuple[float, float] | None = None) -> list[str]:
    """The goals' lines; ``bounds``: ``lru_bound``'s (aware, load-only) loads per request."""
    lines = []
    for arm in arms.values():
        per = f"{arm.loads_per_request:.3f}" if arm.loads_per_request is not None else "-"
        ttft = f"{arm.median_ttft_ms:.1f} ms" if arm.median_ttft_ms is not None else "-"
        if len(arm.ttfts) > 1:
            ttft += f" (p90 {1000 * statistics.quantiles(arm.ttfts, n=10)[-1]:.1f} ms)"
        lines.append(f"{arm.name:>13}: {arm.loads:.0f} adapter loads, {per} per request; median TTFT {ttft}")
    if bounds is not None:
        lines.append(
            f"{'LRU yardstick':>13}: an ideal adapter-aware router {bounds[0]:.3f} loads per request, "
            f"random spread {bounds[1]:.3f} ({bounds[0] / bounds[1]:.2f})"
        )
    aware, least = arms.get("aware"), arms.get("least")
    if aware and least and aware.loads_per_request is not None and least.loads_per_request:
        ratio = aware.loads_per_request / least.loads_per_request
        lines.append(f"goal: adapter loads per request, aware / load-only <= 0.5: {ratio:.2f}: {verdict(ratio <= 0.5)}")
    if aware and least and aware.median_ttft_ms is not None and least.median_ttft_ms is not None:
        ok = aware.median_ttft_ms <= least.median_ttft_ms
        lines.append(
            f"goal: median TTFT no worse: aware {aware.median_ttft_ms:.1f} ms vs load-only "
            f"{least.median_ttft_ms:.1f} ms ({aware.median_ttft_ms / least.median_ttft_ms:.2f}x): {verdict(ok)}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--arms", default="aware,least", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--shape", default="tiny", help="a bench.engine.shapes shape (random weights)")
    p.add_argument("--config-dir", default="", help="instead: a folder with config.json and a tokenizer")
    p.add_argument("--adapters", type=int, default=200)
    p.add_argument("--rank", type=int, default=8, help="every adapter's rank (and --max_lora_rank)")
    p.add_argument("--max-loras", type=int, default=8, help="device slots a worker (--max_loras)")
    p.add_argument("--zipf-a", type=float, default=1.1, help="adapter k's popularity ~ 1 / k**a")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--request-rate", type=float, default=10.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--vocab", type=int, default=0, help="prompt ids below this (0: the model's vocabulary)")
    p.add_argument("--serve-args", default="", help="more lightq serve flags, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8210)
    p.add_argument("--metrics-port", type=int, default=9310)
    p.add_argument("--start-timeout-s", type=float, default=180)
    p.add_argument("--bench-timeout-s", type=float, default=240)
    p.add_argument("--request-timeout-s", type=float, default=120)
    p.add_argument("--deadline-s", type=float, default=460, help="every stage of every arm within this")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "lora_route"), help="logs, model, adapters")
    args = p.parse_args(argv)
    if set(args.arms.split(",")) - set(ARMS):
        p.error(f"--arms: of {', '.join(ARMS)}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    clock = Clock(args.deadline_s)
    folder = model_dir(args)
    config = json.loads((Path(folder.removeprefix("dummy:")) / "config.json").read_text())
    args.vocab = args.vocab or config["vocab_size"]
    specs = adapter_specs(args, folder.removeprefix("dummy:"))
    arms = {key: run_arm(args, key, folder, specs, clock) for key in args.arms.split(",")}
    names = [name for _, name, _ in workload(args)]
    bounds = tuple(lru_bound(names, args.workers, args.max_loras, aware) for aware in (True, False))
    lines = compare(arms, (bounds[0], bounds[1]))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
