"""What runs of chunks cost a stream's latency: the same arrivals with each ``--stream_flush_ms``.

    .venv/bin/python -m bench.serving.flush_latency                          # 0 (every step) and 50 ms
    .venv/bin/python -m bench.serving.flush_latency --flush-ms 0,20,50,100 --step-ms 25

``lightq serve`` on the counting model whose forward also waits ``--step-ms`` with its cores idle,
as a host waits on a device (6 ms: an H200's Llama-3-8B decode step at 16 req/s; 25 ms: at its full
batch), one worker, an embedded Redis; ``bench.serving.serve_bench`` sends ``--requests`` requests at
``--rate`` per second through ``/generate_stream`` (ShareGPT-like lengths, seed 0), once per flush
interval, each on a server of its own. Per interval one line: time to first token, inter-token
latency (every gap between two SSE events a client got: a run's tokens come together), the time per
output token, and the longest gap within a request (MTPOT), medians and p99 as clients saw them,
with the Redis commands per token the run took.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import redis

from bench.serving.path_bench import REPO, start_serve
from shared.embedded_redis import start_embedded_redis

FLAGS = ["--model_dir", "counting", "--workers", "1"]


def one(flush_ms: float, args) -> dict:
    server = start_embedded_redis()
    folder = Path(tempfile.mkdtemp(prefix="lightq-flush-"))
    extra = ["--stream_flush_ms", str(flush_ms), "--counting_step_ms", str(args.step_ms)]
    process, http = start_serve(REPO, server.url, folder / "serve.log", extra, FLAGS)
    client = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        before = sum(v["calls"] for v in client.info("commandstats").values())
        out = folder / "result.json"
        command = [
            sys.executable,
            "-m",
            "bench.serving.serve_bench",
            "--base-url",
            http,
            "--num-prompts",
            str(args.requests),
        ]
        command += ["--request-rate", str(args.rate), "--percentiles", "50,99", "--result-json", str(out)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
        result = json.loads(out.read_text())
        calls = sum(v["calls"] for v in client.info("commandstats").values()) - before
        result["commands_per_token"] = calls / max(1, result["total_output_tokens"])
        return result
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=90)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flush-ms", default="0,50", help="comma-separated --stream_flush_ms values")
    parser.add_argument("--step-ms", type=float, default=6.0, help="the stand-in's device step")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=16.0)
    args = parser.parse_args()
    print(f"flush_latency: counting model, {args.step_ms} ms steps, {args.requests} requests at {args.rate}/s")
    for flush_ms in (float(x) for x in args.flush_ms.split(",")):
        r = one(flush_ms, args)
        ttft, itl, tpot = r["ttft_ms"], r["itl_ms"], r["tpot_ms"]
        print(
            f"flush_latency --stream_flush_ms {flush_ms:g}: TTFT median {ttft['median']:.1f} p99 {ttft['p99']:.1f} ms, "
            f"ITL median {itl['median']:.2f} p99 {itl['p99']:.1f} ms, TPOT median {tpot['median']:.2f} ms, "
            f"MTPOT median {r['mtpot_ms']['median']:.1f} p99 {r['mtpot_ms']['p99']:.1f} ms, "
            f"{r['commands_per_token']:.3f} Redis commands/token, {r['output_throughput']:,.0f} tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
