"""Cache-aware routing against least-loaded routing on the multi-turn workload, in one run (issue 17).

    # four workers sharing one GPU (bench/device/h200.sh route4); on a CPU, the counting model:
    .venv/bin/python -m bench.serving.route_bench --workers 4 --serve-args "--model_dir counting" \\
        --multiturn 32,4,512,128,32 --vocab-size 4096

Per arm, a fresh ``lightq serve --workers N`` (its own embedded Redis; workers on
one GPU share its memory by ``--gpu_share``, ``lightq.launcher``), then
``bench.serving.serve_bench --dataset multiturn`` against it, then the workers' own
counters from their ``--metrics_port`` endpoints (serve gives every child the
same port and each takes the next free one above it, so the ports from
``--metrics-port`` up are read): the cluster hit rate is the sum of
``worker_prefix_hit_tokens_total`` over the sum of
``worker_prefix_asked_tokens_total``. Arms (``--arms``): ``aware`` (the
default routing), ``least`` (``--no-cache_aware``: by load alone), ``one``
(one worker with the whole device). Printed at the end, the issue's goals:
the aware cluster's hit rate within 10% of one worker's (measured if ``one``
ran; the workload's bound otherwise: every token a turn resends from the one
before, what a worker that never evicts finds), and least-loaded's median
TTFT over aware's (at least 1.5). Every stage is bounded by ``--deadline-s``
in all, so a device call cannot overrun.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

ARMS = {  # arm -> (what it is called, extra serve flags, workers: None = --workers)
    "aware": ("cache-aware", [], None),
    "least": ("least-loaded", ["--no-cache_aware"], None),
    "one": ("one worker", [], 1),
}


@dataclass
class Arm:
    name: str
    hit: float = 0.0  # prompt tokens served from cache, over the workers
    asked: float = 0.0  # tokens looked up
    workers: int = 0  # metric endpoints that answered as workers
    decisions: dict[str, float] = field(default_factory=dict)
    result: dict | None = None  # serve_bench's

    @property
    def hit_rate(self) -> float:
        return self.hit / self.asked if self.asked else 0.0

    @property
    def median_ttft(self) -> float | None:
        return self.result["ttft_ms"]["median"] if self.result else None


def workload_bound(spec: str) -> float:
    """The multi-turn workload's hit rate when nothing is evicted: turn k resends turn k-1's prompt
    and reply, whose K/V are cached but for the reply's last token (never fed); a prompt's own last
    token is never looked up, but counts as asked. ``spec``: serve_bench's --multiturn."""
    chats, turns, system, user, output = (int(x) for x in spec.split(","))
    prompts = [system + k * user + (k - 1) * output for k in range(1, turns + 1)]
    reusable = [prompts[k - 1] + output - 1 for k in range(1, turns)]
    return sum(reusable) / sum(prompts)


class Clock:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self, most: float) -> float:
        return max(0.0, min(most, self.end - time.monotonic()))


def start(args, arm: str, log_path: str, clock: Clock) -> subprocess.Popen | None:
    _, extra, workers = ARMS[arm]
    command = [
        sys.executable, "-m", "lightq.cli", "serve", "--port", str(args.port),
        "--workers", str(workers or args.workers), "--metrics_port", str(args.metrics_port),
        "--data_dir", tempfile.mkdtemp(prefix="route_bench-"), *shlex.split(args.serve_args), *extra,
        *(shlex.split(args.one_args) if arm == "one" else []),
    ]  # fmt: skip
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
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


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def bench(args, arm: str, out: str, clock: Clock) -> dict | None:
    result_path = os.path.join(out, f"result_{arm}.json")
    command = [
        sys.executable, "-m", "bench.serving.serve_bench", "--base-url", f"http://127.0.0.1:{args.port}",
        "--dataset", "multiturn", "--multiturn", args.multiturn, "--request-rate", str(args.request_rate),
        "--think-s", str(args.think_s), "--vocab-size", str(args.vocab_size), "--percentiles", "50,99",
        "--result-json", result_path,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=clock.left(args.bench_timeout_s))
    except subprocess.TimeoutExpired:
        print(f"{arm}: serve_bench ran out of time")
        return None
    with open(os.path.join(out, f"bench_{arm}.log"), "w") as f:
        f.write(done.stdout + done.stderr)
    keep = ("conversations", "Successful", "Failed", "duration", "Output token", "Median TTFT", "P99 TTFT", "error")
    print("\n".join(f"  {line}" for line in done.stdout.splitlines() if any(k in line for k in keep)))
    if done.returncode != 0 or not os.path.exists(result_path):
        print(f"{arm}: serve_bench exited {done.returncode}: {done.stderr[-1000:]}")
        return None
    with open(result_path) as f:
        return json.load(f)


def scrape(first_port: int, count: int, arm: Arm) -> None:
    """Add every worker's prefix counters and the router's decisions from ports first_port.. ."""
    for port in range(first_port, first_port + count):
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        samples = [s for family in text_string_to_metric_families(body) for s in family.samples]
        names = {s.name for s in samples}
        arm.workers += "lightq:worker_prefix_asked_tokens_total" in names
        for s in samples:
            if s.name == "lightq:worker_prefix_hit_tokens_total":
                arm.hit += s.value
            elif s.name == "lightq:worker_prefix_asked_tokens_total":
                arm.asked += s.value
            elif s.name == "lightq:router_decisions_total":
                arm.decisions[s.labels["reason"]] = arm.decisions.get(s.labels["reason"], 0) + s.value


def run_arm(args, arm_key: str, clock: Clock) -> Arm:
    arm = Arm(ARMS[arm_key][0])
    process = start(args, arm_key, os.path.join(args.out, f"serve_{arm_key}.log"), clock)
    if process is None:
        return arm
    try:
        arm.result = bench(args, arm_key, args.out, clock)
        scrape(args.metrics_port, (ARMS[arm_key][2] or args.workers) + 4, arm)
    finally:
        stop(process)
    decisions = ", ".join(f"{reason} {n:.0f}" for reason, n in sorted(arm.decisions.items()))
    print(f"{arm.name}: {arm.workers} workers read; cluster hit rate {arm.hit_rate:.3f} "
          f"({arm.hit:,.0f} of {arm.asked:,.0f} tokens looked up); router decisions: {decisions or '-'}")  # fmt: skip
    return arm


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def compare(arms: dict[str, Arm], bound: float) -> list[str]:
    """The issue's two comparisons, as lines."""
    lines = []
    for arm in arms.values():
        ttft = f"{arm.median_ttft:.1f} ms" if arm.median_ttft is not None else "-"
        lines.append(f"{arm.name:>12}: cluster hit rate {arm.hit_rate:.3f}, median TTFT {ttft}")
    aware, least, one = arms.get("aware"), arms.get("least"), arms.get("one")
    lines.append(f"{'workload':>12}: hit rate {bound:.3f} if nothing is evicted (one worker's at most)")
    if aware is not None and aware.asked:
        ref, what = (one.hit_rate, "one worker's, measured") if one and one.asked else (bound, "the workload's bound")
        within = aware.hit_rate >= 0.9 * ref
        lines.append(
            f"goal: cache-aware cluster hit rate within 10% of one worker's: {aware.hit_rate:.3f} vs {ref:.3f} "
            f"({what}; {100 * (aware.hit_rate / ref - 1) if ref else 0:+.1f}%): {verdict(within)}"
        )
    if aware and least and aware.median_ttft and least.median_ttft is not None:
        ratio = least.median_ttft / aware.median_ttft
        lines.append(
            f"goal: median TTFT least-loaded / cache-aware >= 1.5: {least.median_ttft:.1f} / "
            f"{aware.median_ttft:.1f} ms = {ratio:.2f}x: {verdict(ratio >= 1.5)}"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--arms", default="aware,least", help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--serve-args", default="--model_dir counting", help="more lightq serve flags, one string")
    p.add_argument(
        "--one-args", default="", help="flags for the one-worker arm only, after --serve-args (a CPU pool's size)"
    )
    p.add_argument("--multiturn", default="32,4,512,128,128", help="serve_bench's: chats,turns,system,user,output")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="conversations started per second")
    p.add_argument(
        "--think-s", type=float, default=0.0, help="serve_bench's: mean seconds between a reply and the next turn"
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="synthetic ids below this (the model's vocabulary)")
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--metrics-port", type=int, default=9300)
    p.add_argument("--start-timeout-s", type=float, default=180)
    p.add_argument("--bench-timeout-s", type=float, default=240)
    p.add_argument("--deadline-s", type=float, default=460, help="every stage of every arm within this")
    p.add_argument("--out", default=tempfile.gettempdir(), help="logs and results go here")
    args = p.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        p.error(f"unknown arms: {', '.join(sorted(unknown))}")
    return args


def main(argv: list[str] | None = None) -> list[str]:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    clock = Clock(args.deadline_s)
    arms = {key: run_arm(args, key, clock) for key in args.arms.split(",")}
    lines = compare(arms, workload_bound(args.multiturn))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
