"""The engine alone, then the same burst through ``lightq serve``: what users get of it.

    python3 -m bench.serving.whole_path --model-shape llama3-8b             # on a GPU host (bench/device/h200.sh whole)
    python3 -m bench.serving.whole_path --model-shape tiny --device cpu --num-requests 64   # a smoke run on a CPU
    python3 -m bench.serving.whole_path --quantization fp8 --kv-cache-dtype fp8_e4m3   # both runs in FP8 (issue 31)

Three runs of the offline workload (``bench.engine.offline``: ShareGPT-like
lengths, seed 0, token-id prompts, ``ignore_eos``, everything sent at once),
in one process tree and one lease:

1. the engine alone, ``bench.engine.offline`` in a subprocess (no Redis, no HTTP);
2. ``lightq serve`` (embedded Redis, producer, router, one worker with the
   same pool settings as the offline run), every request at once through
   ``POST /generate``;
3. the same server through ``/generate_stream`` at rate inf
   (``bench.serving.serve_bench`` over ``--clients`` processes), which also gives
   the inter-token latency as clients see it.

Prints a table and one line: the three output throughputs, the two ratios
to the engine, the stream's median ITL and TPOT as clients saw them, and
the median gap between consecutive chunks of a request as Redis stamped
them (XADD ids, ms): about one decode step when the publisher writes each
step as it comes, ~0 when it writes several steps at once.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

from bench.engine.shapes import SHAPES, config_dir
from bench.serving import serve_bench
from shared.embedded_redis import free_port, start_embedded_redis

READY_TIMEOUT_S = 600


def engine_alone(args) -> float:
    command = [
        sys.executable,
        "-m",
        "bench.engine.offline",
        "--model-shape",
        args.model_shape,
        "--device",
        args.device,
        "--num-requests",
        str(args.num_requests),
        "--running-max",
        str(args.running_max),
        "--graph-max-bs",
        str(args.running_max),
        "--quantization",
        args.quantization,
        "--kv-cache-dtype",
        args.kv_cache_dtype,
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    # "lightq SHAPE: ..." or, in FP8, "lightq SHAPE fp8 fp8-kv: ..."
    line = next(x for x in out.splitlines() if x.startswith(f"lightq {args.model_shape}") and "output tok/s" in x)
    print(line, flush=True)
    return float(re.search(r"([\d,]+) output tok/s", line).group(1).replace(",", ""))


def start_serve(args, log_path: Path, redis_url: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "lightq.cli",
        "serve",
        "--port",
        str(port),
        "--workers",
        "1",
        "--redis_url",
        redis_url,
        "--redis_key_prefix",
        "lightq-whole",
        "--model_dir",
        f"dummy:{config_dir(args.model_shape, tokenizer=True)}",
        "--max_req_total_len",
        "2048",
        "--device",
        args.device,
        "--running_max_req_size",
        str(args.running_max),
        "--graph_max_batch_size",
        str(args.running_max),
        "--batch_max_tokens",
        "8192",
        "--max_queue_tokens",
        "0",
        # Both runs send the same burst to this one server: with the prefix cache the second would find
        # every prompt cached (it ran 1.20x the engine alone on 2026-12-02), which the engine alone never does.
        "--no-prefix_cache",
        "--quantization",
        args.quantization,
        "--kv_cache_dtype",
        args.kv_cache_dtype,
        *args.serve_args.split(),
    ]
    process = subprocess.Popen(command, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"lightq serve exited:\n{log_path.read_text()[-3000:]}")
        if "lightq ready" in log_path.read_text():
            return process, f"http://127.0.0.1:{port}"
        time.sleep(1)
    process.kill()
    raise RuntimeError(f"lightq serve not ready in {READY_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


async def generate_all(http: str, requests: list) -> float:
    """Every request at once through /generate; output tokens per second of wall time."""
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def one(prompt, out_len: int) -> int:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": out_len, "ignore_eos": True}}
            reply = await client.post(f"{http}/generate", json=body)
            reply.raise_for_status()
            return reply.json()["count_output_tokens"]

        await one([5, 6, 7], 4)  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p, o) for p, _, o in requests))
        wall = time.perf_counter() - start
    expected = sum(o for _, _, o in requests)
    if sum(counts) != expected:
        raise RuntimeError(f"/generate delivered {sum(counts)} tokens of {expected}")
    return expected / wall


def chunk_gaps_ms(redis_url: str, skip: set[str], sample: int = 200) -> list[int]:
    """Gaps between consecutive chunk entries of ``sample`` requests, by their XADD ids (ms)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    streams = [key for key in client.scan_iter("lightq-whole:*:chunks", count=1000) if key not in skip][:sample]
    gaps: list[int] = []
    for key in streams:
        stamps = [int(entry_id.split("-")[0]) for entry_id, _ in client.xrange(key)]
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
    client.close()
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--running-max", type=int, default=1024, help="both runs' running_max and graph sizes")
    parser.add_argument("--serve-args", default="", help="more flags for lightq serve")
    # Both runs: the engine's flags of the same names (bench.engine.offline) and the worker's.
    parser.add_argument("--quantization", choices=["none", "fp8", "fp8_w8a16"], default="none")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    parser.add_argument("--clients", type=int, default=4, help="client processes of the stream run")
    args = parser.parse_args()
    vocab = SHAPES[args.model_shape]["vocab_size"]
    requests = serve_bench.synthetic_requests(args.num_requests, 0, vocab, None)  # bench.engine.offline's workload
    engine = engine_alone(args)
    log_path = Path(tempfile.mkdtemp(prefix="lightq-whole-")) / "serve.log"
    redis_server = start_embedded_redis()
    process, http = start_serve(args, log_path, redis_server.url)
    try:
        generate = asyncio.run(generate_all(http, requests))
        print(f"/generate: {generate:,.0f} output tok/s", flush=True)
        before = set(redis.Redis.from_url(redis_server.url, decode_responses=True).scan_iter("lightq-whole:*:chunks"))
        stream = serve_bench.main(
            [
                "--base-url",
                http,
                "--num-prompts",
                str(args.num_requests),
                "--vocab-size",
                str(vocab),
                "--percentiles",
                "50,90,99",
                "--clients",
                str(args.clients),
            ]
        )
        gaps = chunk_gaps_ms(redis_server.url, skip=before)  # the stream run's requests alone
    finally:
        process.terminate()
        process.wait(120)
        redis_server.stop()
    print(
        "".join(
            line for line in log_path.read_text().splitlines(keepends=True) if " wrote " in line and "steps in" in line
        )
    )
    rate = stream["output_throughput"]
    print(f"\n{'path':<34}{'output tok/s':>14}{'of engine':>11}")
    for name, value in [
        ("engine alone (bench.engine.offline)", engine),
        ("lightq serve, /generate", generate),
        ("lightq serve, /generate_stream", rate),
    ]:
        print(f"{name:<34}{value:>14,.0f}{value / engine:>10.2f}x")
    print(
        f"whole_path {args.model_shape}: engine {engine:,.0f}, /generate {generate:,.0f} "
        f"({generate / engine:.2f}x), /generate_stream {rate:,.0f} ({rate / engine:.2f}x) output tok/s; "
        f"stream median ITL {stream['itl_ms']['median']:.2f} ms, median TPOT {stream['tpot_ms']['median']:.2f} ms; "
        f"chunk gap in Redis median {statistics.median(gaps or [0]):.0f} ms, "
        f"share of 0 ms {sum(g == 0 for g in gaps) / max(1, len(gaps)):.2f}"
    )


if __name__ == "__main__":
    main()
