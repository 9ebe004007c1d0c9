"""The counting-model pool on a Redis Cluster of 1 and of 3 primaries, in one run: delivered tokens/s
and each primary's Redis CPU per token (issue 30 item 5).

    .venv/bin/python -m bench.serving.cluster_scale                          # 1 and 3 primaries, 2 workers
    .venv/bin/python -m bench.serving.cluster_scale --workers 8 --requests 800 --new-tokens 400   # a 16-core host

Per size: a cluster of ``P`` primaries without replicas (``tests.cluster.LocalCluster``: real
redis-server >= 7 processes), ``lightq serve --model_dir counting`` on it (``--workers``, rq on a
throw-away plain Redis beside it), a warm-up, then ``--repeat`` bursts of ``--requests`` streamed
requests of ``--new-tokens`` tokens, every token checked (``tests.checker``). Around each burst it
reads ``INFO cpu`` of every primary. Prints, per size, the best burst's tokens/s and per primary
the Redis CPU per token (which one holds the control plane, ``{q}``); then the ratio of 3 to 1.

The ratio shows the cluster lifting Redis's cap only where Redis is the bottleneck: on a machine
whose cores the workers and producer already fill (the 2-core build machine), both sizes deliver
what the pool's CPU gives, and the per-shard CPU is the figure to read (docs/capacity.md).
``--redis-cpu-percent P`` (root, Linux) holds every primary to P% of one core
(``bench.serving.cpu_quota``), so that Redis binds and the ratio is what the primaries buy.
``--control-alone``: with P primaries, the control plane's slot (``{q}``) is the last one's alone and
the request groups are spread over the other P - 1 (equal ranges, as a cluster of P - 1 makes them):
the layout docs/operations.md gives for a Redis-bound pool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

from redis.crc import key_slot

from bench.serving.cpu_quota import CpuQuota
from shared.embedded_redis import start_embedded_redis
from tests.checker import Burst
from tests.cluster import SLOTS, LocalCluster
from tests.integration.stack import start_stack


def cpu_s(node) -> float:
    info = node.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def usec(node) -> dict[str, tuple[int, int]]:
    """(calls, microseconds) of each command on the node (``INFO commandstats``). A script's own
    calls count twice: once as themselves, and inside the EVALSHA's time."""
    stats = node.ask("INFO", "commandstats")  # parsed by redis-py: {name: {calls, usec, ...}}
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"])) for name, v in stats.items()}


def breakdown(before: dict, after: dict, requests: int, tokens: int) -> str:
    """The commands of a burst on one node, costliest first: µs per token, calls per request."""
    rows = []
    for name, (calls, us) in after.items():
        c0, u0 = before.get(name, (0, 0))
        if us > u0:
            rows.append(((us - u0) / tokens, (calls - c0) / requests, name.upper()))
    return ", ".join(f"{name} {us:.3f} ({calls:.2f}/req)" for us, calls, name in sorted(rows, reverse=True)[:14])


def control_alone(primaries: int) -> list[list[tuple[int, int]]]:
    """Slot ranges: P - 1 equal ones without the control slot, then the control slot alone."""
    q, data = key_slot(b"q"), primaries - 1
    layout = []
    for i in range(data):
        lo, hi = i * SLOTS // data, (i + 1) * SLOTS // data - 1
        layout.append([r for r in ((lo, q - 1), (q + 1, hi)) if r[0] <= r[1]] if lo <= q <= hi else [(lo, hi)])
    return layout + [[(q, q)]]


def measure(primaries: int, args) -> tuple[float, list[tuple[str, float, bool]], str, str]:
    """(best tokens/s, per primary (name, Redis CPU us per token, holds the control plane), the control
    primary's costliest commands per token, and a data primary's (none with one primary))."""
    with contextlib.ExitStack() as done:  # whatever started is stopped, a failed start included
        rq = start_embedded_redis()
        done.callback(rq.stop)
        slots = control_alone(primaries) if args.control_alone and primaries > 1 else ()
        cluster = LocalCluster(primaries=primaries, replicas=0, slots=slots).start()  # cleans up its own failure
        done.callback(cluster.stop)
        if args.redis_cpu_percent:  # every primary held to the same share of a core: Redis binds
            for node in cluster.primary_nodes():
                quota = CpuQuota(f"lightq-scale-{os.getpid()}-{node.name}", args.redis_cpu_percent)
                done.callback(quota.remove)  # first out: its nodes go back to the root cgroup, then stop
                quota.hold(node.process.pid)
        return burst_on(cluster, rq, args)


def burst_on(cluster: LocalCluster, rq, args) -> tuple[float, list[tuple[str, float, bool]], str, str]:
    """``measure``'s bursts on a started cluster (rq: the plain Redis beside it)."""
    log = Path(tempfile.mkdtemp(prefix="lightq-cluster-scale-")) / "serve.log"
    extra = ["--model_dir", args.model_dir, "--max_total_token_num", "200000", "--redis_rq_url", rq.url]
    stack = start_stack(
        str(log), redis_url=cluster.url, prefix="lightq-scale", workers=args.workers, extra=extra, timeout_s=900
    )
    try:
        primary_nodes = cluster.primary_nodes()
        control = cluster.owner(stack.keys.requests())
        data = next((n for n in primary_nodes if n is not control), None)
        asyncio.run(Burst(stack.http, requests=8, new_tokens=16, first_token=10).run())  # warm
        if args.idle_s:  # what the pool's polls cost each primary with nothing to do
            before, t0 = [cpu_s(n) for n in primary_nodes], time.monotonic()
            time.sleep(args.idle_s)
            idle = [(cpu_s(n) - b) * 1e3 / (time.monotonic() - t0) for n, b in zip(primary_nodes, before)]
            marks = [f"{n.name}{' (control)' if n is control else ''} {ms:.2f}" for n, ms in zip(primary_nodes, idle)]
            print(f"cluster_scale: {len(primary_nodes)} primaries: idle Redis CPU ms/s: {', '.join(marks)}")
        best, per_token, top, top_data = 0.0, [], "", ""
        for repeat in range(args.repeat):
            before, spent = [cpu_s(n) for n in primary_nodes], usec(control)
            spent_data = usec(data) if data is not None else {}
            burst = Burst(stack.http, requests=args.requests, new_tokens=args.new_tokens, first_token=100 + repeat)
            t0 = time.monotonic()
            asyncio.run(burst.run())
            wall = time.monotonic() - t0
            report = burst.check()
            assert report.lost == report.duplicated == report.wrong == 0, report.line()
            tokens = args.requests * args.new_tokens
            rate = tokens / wall
            if rate > best:
                best = rate
                per_token = [
                    (n.name, (cpu_s(n) - b) * 1e6 / tokens, n is control) for n, b in zip(primary_nodes, before)
                ]
                top = breakdown(spent, usec(control), args.requests, tokens)
                if data is not None:
                    top_data = breakdown(spent_data, usec(data), args.requests, tokens)
        return best, per_token, top, top_data
    finally:
        try:  # a loaded machine can take past the stop's minute: the figures and the nodes go on
            stack.stop()
        except subprocess.TimeoutExpired:
            stack.process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", default="1,3", help="primary counts, in order")
    parser.add_argument("--idle-s", type=float, default=0, help="first, each primary's Redis CPU while idle")
    parser.add_argument("--control-alone", action="store_true", help="the control slot alone on a primary (above)")
    parser.add_argument(
        "--redis-cpu-percent", type=float, default=0, help="hold each primary to this share of a core (root; above)"
    )
    parser.add_argument(
        "--model_dir", default="counting", help="counting, or counting:TOKENIZER_DIR where the embedded model is absent"
    )
    args = parser.parse_args()
    rates = {}
    for size in (int(s) for s in args.sizes.split(",")):
        rate, shards, top, top_data = measure(size, args)
        rates[size] = rate
        split = ", ".join(f"{name}{' (control)' if control else ''} {us:.2f}" for name, us, control in shards)
        total = sum(us for _, us, _ in shards)
        print(f"cluster_scale: {size} primaries: {rate:,.0f} tok/s; Redis CPU us/token {total:.2f} = {split}")
        print(f"cluster_scale: {size} primaries: control primary, us/token (calls/request): {top}")
        if top_data:
            print(f"cluster_scale: {size} primaries: a data primary, us/token (calls/request): {top_data}")
    if 1 in rates and 3 in rates:
        print(f"cluster_scale: 3 primaries / 1 = {rates[3] / rates[1]:.2f}x delivered tokens/s")


if __name__ == "__main__":
    main()
