"""What one token costs the shared parts of a pool: Redis commands, Redis CPU, producer and publisher CPU.

    .venv/bin/python -m bench.serving.redis_cost                       # this tree alone
    .venv/bin/python -m bench.serving.redis_cost --peer d479f38        # and an older commit, in the same run

Starts ``lightq serve --model_dir counting --workers 1`` with its defaults (and
``--serve-args``) on an embedded Redis and, per route, sends ``--requests``
requests of ``--new-tokens`` tokens at once. Around each burst it reads Redis's ``INFO
commandstats`` (commands run inside scripts count: they are work Redis does) and
``INFO cpu``, and the CPU time of every process of the pool from ``/proc``, and
prints per token: Redis commands, Redis CPU, the producer's CPU, the publishers'
CPU and the worker's model loop. From them: the tokens/s one Redis core and one
producer core carry, and how many GPUs at ``--gpu-rate`` tokens/s each that is.

Counts are exact; CPU times on a 2-core machine shared with the client are
noisy (``--repeat`` takes the median of several bursts).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
import redis

from bench.serving.path_bench import REPO, burst, peer_tree, start_serve
from shared.embedded_redis import start_embedded_redis

SERVE_FLAGS = ["--model_dir", "counting", "--workers", "1"]  # issue 29's measurement: serve's defaults
GPU_RATE = 8728.0  # lightq serve /generate on one H200, Llama-3-8B shape (bench/RESULTS.md, 2026-12-05)
ROLES = ("producer", "publisher", "worker", "router", "rq-worker")


@dataclass(frozen=True)
class Snapshot:
    commands: dict[str, int]  # command -> calls
    redis_cpu_s: float
    process_cpu_s: dict[str, float]  # role -> CPU seconds of its processes


@dataclass(frozen=True)
class Cost:
    """Per token, over one burst."""

    commands: float
    redis_us: float
    top: list[tuple[str, float]]  # the commands most called, per token
    role_us: dict[str, float]

    def line(self) -> str:
        roles = ", ".join(f"{r} {self.role_us.get(r, 0):.1f}" for r in ROLES[:3])
        top = ", ".join(f"{c.upper()} {n:.2f}" for c, n in self.top)
        return f"{self.commands:.3f} commands, Redis {self.redis_us:.2f} us, CPU us: {roles} ({top})"


def role_of(process: psutil.Process) -> str | None:
    """A pool process's role from its command line (serve's children run ``lightq.cli ROLE``;
    a worker's publishers are its multiprocessing children)."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return None
    if "lightq.cli" in cmdline:
        role = cmdline[cmdline.index("lightq.cli") + 1]
        return role if role in ROLES else None
    if any("multiprocessing" in part for part in cmdline):
        parent = process.parent()
        return "publisher" if parent is not None and role_of(parent) == "worker" else None
    return None


def snapshot(client: redis.Redis, serve: psutil.Process) -> Snapshot:
    stats = client.info("commandstats")
    commands = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    cpu = client.info("cpu")
    per_role: dict[str, float] = {}
    for process in serve.children(recursive=True):
        role = role_of(process)
        if role is None:
            continue
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        per_role[role] = per_role.get(role, 0.0) + times.user + times.system
    return Snapshot(commands, float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), per_role)


def cost(before: Snapshot, after: Snapshot, tokens: int) -> Cost:
    calls = {c: n - before.commands.get(c, 0) for c, n in after.commands.items() if c != "info"}
    top = sorted(((c, n / tokens) for c, n in calls.items() if n), key=lambda item: -item[1])[:5]
    roles = {r: (after.process_cpu_s.get(r, 0) - before.process_cpu_s.get(r, 0)) * 1e6 / tokens for r in ROLES}
    return Cost(sum(calls.values()) / tokens, (after.redis_cpu_s - before.redis_cpu_s) * 1e6 / tokens, top, roles)


def median_cost(costs: list[Cost]) -> Cost:
    """Per figure the median over bursts (the top list of the median-command burst)."""
    by_commands = sorted(costs, key=lambda c: c.commands)[len(costs) // 2]
    return Cost(
        statistics.median(c.commands for c in costs),
        statistics.median(c.redis_us for c in costs),
        by_commands.top,
        {r: statistics.median(c.role_us.get(r, 0) for c in costs) for r in ROLES},
    )


def measure(tree: Path, args, label: str) -> dict[str, tuple[Cost, float]]:
    """Per route: the median cost per token and the best delivered tokens/s."""
    redis_server = start_embedded_redis()
    log_path = Path(tempfile.mkdtemp(prefix="lightq-cost-")) / "serve.log"
    process, http = start_serve(tree, redis_server.url, log_path, args.serve_args, SERVE_FLAGS)
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    serve = psutil.Process(process.pid)
    out = {}
    try:
        for route in args.routes:
            asyncio.run(burst(http, route, 1, 4))  # warm the route
            costs, rates = [], []
            for _ in range(args.repeat):
                before = snapshot(client, serve)
                rates.append(asyncio.run(burst(http, route, args.requests, args.new_tokens)))
                costs.append(cost(before, snapshot(client, serve), args.requests * args.new_tokens))
            out[route] = (median_cost(costs), max(rates))
            print(f"  {label} /{route}: {out[route][0].line()}; {max(rates):,.0f} tok/s", flush=True)
    finally:
        client.close()
        process.terminate()
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
        redis_server.stop()
        shutil.rmtree(log_path.parent, ignore_errors=True)  # its serve.log: a run leaves nothing behind
    return out


def capacity(c: Cost, gpu_rate: float) -> str:
    redis_rate = 1e6 / max(c.redis_us, 1e-9)
    producer_rate = 1e6 / max(c.role_us["producer"], 1e-9)
    return (
        f"one Redis core {redis_rate:,.0f} tok/s ({redis_rate / gpu_rate:.1f} GPUs at {gpu_rate:,.0f}), "
        f"one producer core {producer_rate:,.0f} tok/s ({producer_rate / gpu_rate:.1f} GPUs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--routes", default="generate,generate_stream")
    parser.add_argument("--repeat", type=int, default=3, help="bursts per route; each figure is their median")
    parser.add_argument("--peer", help="an older commit to run first, in the same run")
    parser.add_argument("--gpu-rate", type=float, default=GPU_RATE, help="tokens/s one GPU makes, for the capacity")
    parser.add_argument("--serve-args", default="", help="extra flags for lightq serve (both trees)")
    args = parser.parse_args()
    args.routes = args.routes.split(",")
    args.serve_args = args.serve_args.split()
    print(f"redis_cost: counting model, 1 worker, {args.requests} x {args.new_tokens} tokens at once", flush=True)
    peer = None
    if args.peer:
        tree = peer_tree(args.peer)
        try:
            peer = measure(tree, args, f"peer {args.peer}")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
            shutil.rmtree(tree, ignore_errors=True)
    ours = measure(REPO, args, "this tree")
    for route in args.routes:
        c, rate = ours[route]
        line = f"redis_cost /{route}: {c.commands:.3f} commands/token, Redis {c.redis_us:.2f} us/token, "
        line += f"producer+publishers {c.role_us['producer'] + c.role_us['publisher']:.1f} us/token"
        if peer is not None:
            p, _ = peer[route]
            pp = p.role_us["producer"] + p.role_us["publisher"]
            line += f" (peer {args.peer}: {p.commands:.3f}, {p.redis_us:.2f} us, {pp:.1f} us"
            line += f"; {c.commands / p.commands:.2f}x, {c.redis_us / p.redis_us:.2f}x, "
            line += f"{(c.role_us['producer'] + c.role_us['publisher']) / pp:.2f}x)"
        print(line)
        print(f"  capacity /{route}: {capacity(c, args.gpu_rate)}")


if __name__ == "__main__":
    main()
