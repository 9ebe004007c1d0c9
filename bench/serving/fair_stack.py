"""Priorities and fair shares (issue 19) on the real stack: ``lightq serve`` on the counting model.

    .venv/bin/python -m bench.serving.fair_stack            # about 1.5 minutes on 2 cores
    .venv/bin/python -m bench.serving.fair_stack --preempt --only priority   # class 1 paused for class 0

One CPU worker (``--running_max_req_size`` small, so the pool is what limits), an embedded
Redis, API keys naming two tenants (``hi:`` and ``lo:``). Requests go through
``/generate_stream`` with ``parameters.priority``; a request's time to first token is
measured at the client (send -> first event). First the pool's capacity in requests/s is
measured closed-loop, then:

1. class 0 (tenant ``hi``) at ``--hi_load`` x capacity alone, then with class 1 (tenant ``lo``)
   making the offered load ``--overload`` x capacity: class 0's p99 TTFT in both.
2. one class, tenant ``lo`` keeping 10x as many requests outstanding as ``hi``: tokens each
   received in the window and Jain's index, with fair shares and with both keys in one tenant.

The client shares the two cores with the pool, so absolute times are this machine's; the
ratios are the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis

from bench.serving.path_bench import REPO, start_serve
from bench.sim.fair_sim import jain
from shared.chunk_schemas import TokenChunk
from shared.codec import from_entry
from shared.embedded_redis import free_port, start_embedded_redis
from shared.keys import Keys

KEYS = {"hi": "k-hi-0123456789", "lo": "k-lo-0123456789"}


async def one(client: httpx.AsyncClient, http: str, tenant: str, priority: int, args, log: list) -> None:
    """One streamed request; appends (tenant, priority, sent, first token, tokens, end) to ``log``."""
    body = {
        "inputs": [random.randrange(1, 200)],
        "parameters": {"max_new_tokens": args.output_len, "ignore_eos": True, "priority": priority},
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    sent, first, times = time.monotonic(), None, []
    async with client.stream("POST", f"{http}/generate_stream", json=body, headers=headers) as reply:
        reply.raise_for_status()
        args.followed.append((sent, reply.headers.get("x-request-id")))
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                now = time.monotonic()
                first = first or now
                times.append(now)
                if json.loads(line[5:]).get("finished"):
                    break
    log.append((tenant, priority, sent, first, times))


async def submit_only(client: httpx.AsyncClient, http: str, tenant: str, priority: int, args, log: list) -> None:
    """A request through ``POST /v1/requests`` and not followed: background load that keeps no
    stream open in this client (hundreds of open streams would make the client the bottleneck)."""
    body = {
        "inputs": [random.randrange(1, 200)],
        "parameters": {"max_new_tokens": args.output_len, "ignore_eos": True, "priority": priority},
    }
    reply = await client.post(f"{http}/v1/requests", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    reply.raise_for_status()


async def open_loop(http: str, streams: list[tuple[str, int, float]], seconds: float, args) -> list:
    """Poisson arrivals per (tenant, priority, requests/s); class 0 streamed, the others submitted.
    Each stream draws from its own generator, seeded by its name: class 0's arrivals are the same
    instants with and without class 1 (one generator for all made them a different, differently
    bursty, sequence in each phase, and the p99 of ~100 samples is its few worst bursts)."""
    log: list = []
    rngs = [random.Random(f"{tenant}:{priority}") for tenant, priority, _ in streams]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=4000)) as client:
        tasks, end = [], time.monotonic() + seconds
        due = [time.monotonic() + rng.expovariate(rate) for rng, (*_, rate) in zip(rngs, streams)]
        while time.monotonic() < end:
            i = min(range(len(streams)), key=due.__getitem__)
            await asyncio.sleep(max(0.0, due[i] - time.monotonic()))
            tenant, priority, rate = streams[i]
            send = one if priority == 0 else submit_only
            tasks.append(asyncio.create_task(send(client, http, tenant, priority, args, log)))
            due[i] += rngs[i].expovariate(rate)
        await asyncio.wait(tasks, timeout=60)
    return log


async def closed_loop(http: str, outstanding: dict[str, tuple[str, int]], seconds: float, args) -> list:
    """Keep n requests of each label in flight (label -> (tenant key, n)); logs under the label."""
    log: list = []

    async def keep(client, label: str, tenant: str, end: float) -> None:
        while time.monotonic() < end:
            mine: list = []
            await one(client, http, tenant, 0, args, mine)
            log.extend((label, *row[1:]) for row in mine)

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=4000)) as client:
        end = time.monotonic() + seconds
        await asyncio.gather(
            *(keep(client, label, tenant, end) for label, (tenant, n) in outstanding.items() for _ in range(n))
        )
    return log


def capacity(http: str, args, metrics_port: int) -> float:
    """The pool's requests/s when it is never short of work: a backlog of ``4 x batch`` requests
    kept topped up through ``POST /v1/requests`` (no streams: a closed loop of streamed requests
    measures the client as much as the pool, and underestimated it 2x on a 16-core host), rated
    by the worker's own output-token counter over the second half of ``window_s``."""

    async def run() -> float:
        done = lambda: generated(metrics_port) / args.output_len  # noqa: E731
        start, submitted = done(), 0
        began = time.monotonic()
        marks: list[tuple[float, float]] = []
        async with httpx.AsyncClient(timeout=600) as client:
            while (now := time.monotonic()) < began + args.window_s:
                finished = done()
                if now >= began + args.window_s / 2:
                    marks.append((now, finished))
                missing = 4 * args.batch - (submitted - (finished - start))
                if missing > 0:
                    await asyncio.gather(*(submit_only(client, http, "hi", 0, args, []) for _ in range(int(missing))))
                    submitted += int(missing)
                await asyncio.sleep(0.05)
        while done() - start < submitted and time.monotonic() < began + args.window_s + 60:
            await asyncio.sleep(0.1)  # drained before the measured phases start
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        return (n1 - n0) / (t1 - t0)

    return asyncio.run(run())


def generated(metrics_port: int) -> float:
    """The worker's output tokens so far."""
    return worker_counter(metrics_port, "lightq:worker_generation_tokens_total")


def worker_steps(metrics_port: int) -> tuple[float, float, float]:
    """The worker's steps so far: (count, seconds in them, requests in the batch after each, summed)."""
    names = ["step_seconds_count", "step_seconds_sum", "batch_requests_sum"]
    count, seconds, rows = (worker_counter(metrics_port, f"lightq:worker_{n}") for n in names)
    return count, seconds, rows


def steps_line(before: tuple[float, float, float], after: tuple[float, float, float], wall: float) -> str:
    """Where a phase's throughput went: the share of it the worker spent stepping, its step time and
    batch (served = busy share x batch / step time): fewer rows is scheduling, longer steps the host."""
    count, seconds, rows = (b - a for a, b in zip(before, after))
    if not count:
        return "worker: no steps"
    return (
        f"worker: stepping {seconds / wall:.0%} of the phase, {count:.0f} steps of {seconds / count * 1000:.1f} ms, "
        f"{rows / count:.2f} requests a step"
    )


def dispatched_tokens(redis_url: str, http: str) -> dict[str, int]:
    """Tokens dispatched per 'priority:tenant' so far (the router's counters in Redis)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"lightq-path-{http.rsplit(':', 1)[1]}"  # path_bench.start_serve's key prefix
    return {k: int(v) for k, v in client.hgetall(Keys(prefix).tenant_served()).items()}


def check_outputs(redis_url: str, http: str) -> tuple[int, int]:
    """(requests, those whose chunk stream is not exact): each index once (a copy written twice by a
    retry must carry the same token) and, the counting model's rule, each token the one before plus
    one. A preempted request resumed after the wrong index would break either."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"lightq-path-{http.rsplit(':', 1)[1]}"
    checked = bad = 0
    for key in client.scan_iter(match=f"{prefix}:*:chunks", count=1000):
        tokens: dict[int, int] = {}
        ok = True
        for _, fields in client.xrange(key):
            chunk = from_entry(TokenChunk, fields)
            if chunk.token_id is not None:
                ok &= tokens.setdefault(chunk.index, chunk.token_id) == chunk.token_id
        ids = [tokens[i] for i in sorted(tokens)]
        ok &= sorted(tokens) == list(range(len(tokens))) and all(b == a + 1 for a, b in zip(ids, ids[1:]))
        checked, bad = checked + 1, bad + (not ok)
    return checked, bad


def hops(redis_url: str, http: str, followed: list, start: float) -> str:
    """p50 / p99 of the followed requests' hops from their status hashes (sent from ``start``): queued
    -> dispatched (the router), dispatched -> stepped (the worker: inbox read, pause, admission,
    prefill)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    prefix = f"lightq-path-{http.rsplit(':', 1)[1]}"
    metas = [client.hgetall(Keys(prefix).meta(rid)) for sent, rid in followed if sent >= start and rid]
    router = [int(m["dispatched_ms"]) - int(m["created_ms"]) for m in metas if m.get("dispatched_ms")]
    worker = [int(m["stepped_ms"]) - int(m["dispatched_ms"]) for m in metas if m.get("stepped_ms")]
    pct = lambda xs: "/".join(f"{np.percentile(xs, q):.0f}" for q in (50, 99)) if xs else "-"  # noqa: E731
    return f"hops p50/p99 ms: queued->dispatched {pct(router)}, dispatched->stepped {pct(worker)}"


def preemptions(log_path: Path) -> int:
    """Requests the workers paused for a better class (their log lines: 'paused [ids] for ...')."""
    lines = [line for line in log_path.read_text().splitlines() if "paused [" in line]
    return sum(line.split("paused [", 1)[1].split("]", 1)[0].count("'") // 2 for line in lines)


def worker_counter(metrics_port: int, name: str) -> float:
    """A worker counter off the metrics ports from ``metrics_port`` up (the router and the worker
    each take the next free one, in whichever order they start)."""
    for port in range(metrics_port, metrics_port + 4):
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except httpx.HTTPError:
            continue
        for line in text.splitlines():
            if line.startswith(f"{name}{{"):
                return float(line.rsplit(" ", 1)[1])
    return float("nan")


def p99_ttft(log: list, priority: int, start: float) -> tuple[float, int]:
    waits = [(first - sent) * 1000 for _, p, sent, first, _ in log if p == priority and sent >= start and first]
    return float(np.percentile(waits, 99)), len(waits)


def priority_phases(http: str, redis_url: str, metrics_port: int, log_path: Path, args) -> None:
    """The pool's capacity, then class 0 alone and with class 1 at ``--overload``: class 0's p99 TTFT
    in both (the same arrivals), the worker's steps, the pauses and their cost, exact outputs."""
    steps0, t0 = worker_steps(metrics_port), time.monotonic()
    cap = capacity(http, args, metrics_port)
    hi, lo = args.hi_load * cap, (args.overload - args.hi_load) * cap
    print(f"capacity {cap:.1f} req/s ({args.output_len} tokens each); class 0 at {hi:.1f}, class 1 at {lo:.1f} req/s")
    print(f"  {steps_line(steps0, worker_steps(metrics_port), time.monotonic() - t0)} (its drain included)")
    ttft, lo_before = {}, 0
    for name, streams in [("alone", [("hi", 0, hi)]), ("with class 1", [("hi", 0, hi), ("lo", 1, lo)])]:
        t0, args.followed, tokens0 = time.monotonic(), [], generated(metrics_port)
        steps0 = worker_steps(metrics_port)
        log = asyncio.run(open_loop(http, streams, args.warmup_s + args.window_s, args))
        wall = time.monotonic() - t0
        rate = (generated(metrics_port) - tokens0) / wall / args.output_len
        # Overload is real only if the pool served about its capacity (the rest queued).
        print(f"  the pool served {rate:.1f} req/s ({rate / cap:.0%} of capacity) {name}")
        print(f"  {steps_line(steps0, worker_steps(metrics_port), wall)}")
        ttft[name], n = p99_ttft(log, 0, t0 + args.warmup_s)
        print(f"  {hops(redis_url, http, args.followed, t0 + args.warmup_s)}")
        lo_tokens = dispatched_tokens(redis_url, http).get("1:lo", 0) - lo_before
        lo_before += lo_tokens
        print(f"  class 0 {name:<13} p99 TTFT {ttft[name]:8.1f} ms over {n}; class-1 tokens dispatched {lo_tokens}")
    print(f"  ratio {ttft['with class 1'] / ttft['alone']:.2f} (goal <= 2)")
    checked, bad = check_outputs(redis_url, http)
    print(f"  preempted {preemptions(log_path)} times; {bad} of {checked} outputs with a lost or repeated token")
    # The cost of the pauses: K/V they threw away, prefilled again on resume, against the tokens served.
    recomputed = worker_counter(metrics_port, "lightq:worker_preempted_kv_tokens_total")
    served = sum(dispatched_tokens(redis_url, http).values())
    print(f"  recomputed {recomputed:.0f} K/V tokens for {served} tokens dispatched ({recomputed / served:.1%})")


def flood_phases(http: str, args) -> None:
    """One class, tenant ``lo`` keeping 10x as many requests outstanding as ``hi``: tokens each
    received in the window and Jain's index, with fair shares and with both keys in one tenant."""
    small = args.batch  # more than half the batch: the small tenant always has work waiting
    for name, tenants in [("fair shares", ("lo", "hi")), ("one tenant", ("lo", "lo"))]:
        outstanding = {"flood": (tenants[0], 10 * small), "small": (tenants[1], small)}
        t0 = time.monotonic()
        log = asyncio.run(closed_loop(http, outstanding, args.warmup_s + args.window_s, args))
        start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.window_s
        served = [
            sum(sum(start <= t < end for t in times) for lab, *_, times in log if lab == label) for label in outstanding
        ]
        print(f"  {name:<12} tokens flood {served[0]:>6} small {served[1]:>6}  Jain's index {jain(served):.3f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8, help="the worker's --running_max_req_size")
    p.add_argument("--output_len", type=int, default=32)
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument("--hi_load", type=float, default=0.5)
    p.add_argument("--window_s", type=float, default=12.0)
    p.add_argument("--warmup_s", type=float, default=2.0)
    p.add_argument("--poll_ms", type=int, default=10, help="the router's wait when the head fits no worker")
    p.add_argument("--reserve_slots", type=int, default=0, help="the router's --priority_reserve_slots")
    p.add_argument("--preempt", action="store_true", help="the router's --preempt (pause class 1 for class 0)")
    p.add_argument("--only", choices=["priority", "flood"], help="run one part")
    p.add_argument("--model_dir", default="counting", help="counting:<tokenizer dir> where SmolLM2's package is absent")
    p.add_argument(
        "--step_ms", type=float, default=0.0, help="the counting model's time per forward (--counting_step_ms)"
    )
    p.add_argument("--tree", type=Path, default=REPO, help="the checkout whose lightq serve runs (a peer commit's)")
    args = p.parse_args(argv)
    args.followed = []  # (sent, request id) of the streamed requests, for their hops
    redis_server = start_embedded_redis()
    log_path = Path(tempfile.mkdtemp(prefix="lightq-fair-")) / "serve.log"
    keys = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())
    metrics_port = free_port()
    flags = ["--running_max_req_size", str(args.batch), "--api_keys", keys, "--poll_ms", str(args.poll_ms)]
    model_dir = args.model_dir  # a tokenizer folder made absolute: --tree's serve runs in that tree
    if model_dir.startswith("counting:"):
        model_dir = f"counting:{Path(model_dir.removeprefix('counting:')).resolve()}"
    flags += ["--model_dir", model_dir]
    flags += ["--metrics_port", str(metrics_port)]
    flags += ["--counting_step_ms", str(args.step_ms)] if args.step_ms else []
    flags += ["--priority_reserve_slots", str(args.reserve_slots)] + (["--preempt"] if args.preempt else [])
    process, http = start_serve(args.tree.resolve(), redis_server.url, log_path, flags)
    try:
        if args.only != "flood":
            priority_phases(http, redis_server.url, metrics_port, log_path, args)
        if args.only != "priority":
            flood_phases(http, args)
    finally:
        process.terminate()
        process.wait(timeout=60)
        redis_server.stop()


if __name__ == "__main__":
    main()
