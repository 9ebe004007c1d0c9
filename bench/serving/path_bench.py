"""The whole path with no model cost: how many tokens a worker delivers to clients.

    .venv/bin/python -m bench.serving.path_bench                          # this tree alone
    .venv/bin/python -m bench.serving.path_bench --peer 2cd5fe5            # and an older commit, in the same run
    .venv/bin/python -m bench.serving.path_bench --route generate_stream

Starts ``lightq serve`` on the counting model (``worker.model.counting_model``: a
forward costs next to nothing, so what limits delivery is the engine's host
work, the publisher, Redis and the producer), one worker, an embedded Redis,
then sends ``--requests`` requests of ``--new-tokens`` output tokens at once
(``ignore_eos``) and waits for every answer. Delivered tokens/s is the output
tokens clients received over the time from the first send to the last
answer. Every answer is checked: its token count, and for streams that each
index arrived once, in order.

With ``--peer COMMIT`` the same burst runs first against that commit (a git
worktree in a temporary folder, with this tree's virtual environment and
the stand-in's small vocabulary, ``peer_tree``) and the line compares the two. On a 2-core
machine every process of the pool shares the cores with the client, so the figure is a proxy for where the
path's host work stands, not a serving figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from shared.embedded_redis import free_port, start_embedded_redis
from worker.model.counting_model import COUNTING_VOCAB

REPO = Path(__file__).resolve().parents[2]
SERVE_FLAGS = [
    "--model_dir",
    "counting",
    "--workers",
    "1",
    "--max_total_token_num",
    "400000",
    "--running_max_req_size",
    "1024",
    "--max_queue_tokens",
    "100000000",
]


def start_serve(
    tree: Path, redis_url: str, log_path: Path, extra: list[str], flags: list[str] = SERVE_FLAGS
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # The tree first, then what the caller had (the device's wheels travel in a PYTHONPATH folder).
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "lightq.cli",
        "serve",
        "--port",
        str(port),
        "--redis_url",
        redis_url,
        "--redis_key_prefix",
        f"lightq-path-{port}",
        *flags,
        *extra,
    ]
    process = subprocess.Popen(args, cwd=tree, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    http = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"lightq serve exited early:\n{log_path.read_text()[-3000:]}")
        if "lightq ready" in log_path.read_text():
            return process, http
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"lightq serve not ready:\n{log_path.read_text()[-3000:]}")


async def one(client: httpx.AsyncClient, http: str, route: str, i: int, new_tokens: int) -> int:
    body = {"inputs": [100 + i], "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
    if route == "generate":
        reply = await client.post(f"{http}/generate", json=body)
        reply.raise_for_status()
        return reply.json()["count_output_tokens"]
    count = 0
    async with client.stream("POST", f"{http}/generate_stream", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                count += 1
                if event.get("finished"):
                    break
    return count


async def burst(http: str, route: str, requests: int, new_tokens: int) -> float:
    limits = httpx.Limits(max_connections=requests + 8, max_keepalive_connections=requests + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, http, route, 0, 4)  # warm: the first request loads nothing lazily later
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(client, http, route, i, new_tokens) for i in range(requests)))
        wall = time.perf_counter() - start
    wrong = [c for c in counts if c != new_tokens]
    if wrong:
        raise RuntimeError(f"{len(wrong)} answers had the wrong token count (e.g. {wrong[0]} != {new_tokens})")
    return requests * new_tokens / wall


def measure(tree: Path, args, label: str) -> float:
    redis_server = start_embedded_redis()
    log_path = Path(tempfile.mkdtemp(prefix="lightq-path-")) / "serve.log"
    process, http = start_serve(tree, redis_server.url, log_path, args.serve_args)
    try:
        rates = [asyncio.run(burst(http, args.route, args.requests, args.new_tokens)) for _ in range(args.repeat)]
    finally:
        process.terminate()
        try:
            process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            process.kill()
        redis_server.stop()
    best = max(rates)
    print(f"  {label}: {', '.join(f'{r:,.0f}' for r in rates)} tok/s (best {best:,.0f}); log {log_path}", flush=True)
    return best


def peer_tree(commit: str, vocab: int = COUNTING_VOCAB) -> Path:
    """The commit in a worktree, with this tree's stand-in cost: before 2026-12-01 the counting
    model sampled over the tokenizer's whole vocabulary (49,152), which cost more than the path
    it stands in for; the peer gets the same small vocabulary, so only the path differs.
    ``vocab``: a stand-in vocabulary of this size instead (``--vocab``: both trees get it)."""
    folder = Path(tempfile.mkdtemp(prefix="lightq-peer-"))
    if Path(commit).is_dir():  # a tree made beforehand (`git archive COMMIT | tar -x -C DIR`): no git there
        shutil.copytree(commit, folder, dirs_exist_ok=True)
    else:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(folder), commit],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    main = folder / "worker" / "main.py"
    old = "vocab = len(tokenizer) if tokenizer is not None else 49152"
    text = main.read_text()
    if old in text:
        main.write_text(text.replace(old, f"vocab = min(len(tokenizer), {vocab})"))
    elif "COUNTING_VOCAB" not in text:
        raise RuntimeError(f"cannot give {commit} the stand-in's vocabulary: {main} has neither form")
    stand_in = folder / "worker" / "model" / "counting_model.py"
    constant = f"COUNTING_VOCAB = {COUNTING_VOCAB}"
    if vocab != COUNTING_VOCAB and constant in (text := stand_in.read_text()):
        stand_in.write_text(text.replace(constant, f"COUNTING_VOCAB = {vocab}"))
    return folder


def measure_at(commit: str, args, label: str, vocab: int) -> float:
    tree = peer_tree(commit, vocab)
    try:
        return measure(tree, args, label)
    finally:
        remove = ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)]
        subprocess.run(remove, check=False, stderr=subprocess.DEVNULL)  # a copied folder is no worktree
        shutil.rmtree(tree, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--route", choices=["generate", "generate_stream"], default="generate")
    parser.add_argument("--repeat", type=int, default=2, help="bursts per server; the best counts")
    parser.add_argument(
        "--peer", help="an older commit to run first, in the same run (or a folder holding its files, where no git is)"
    )
    parser.add_argument("--serve-args", default="", help="extra flags for lightq serve (both trees)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=COUNTING_VOCAB,
        help="the stand-in's vocabulary (smaller: its sampling costs less); other than the default, HEAD "
        "runs from a worktree with it too, as the peer does",
    )
    args = parser.parse_args()
    args.serve_args = args.serve_args.split()
    print(
        f"path_bench: counting model, {args.requests} x {args.new_tokens} tokens at once, "
        f"/{args.route}, {os.cpu_count()} cores, serve flags {' '.join(args.serve_args) or '(defaults)'}",
        flush=True,
    )
    peer = measure_at(args.peer, args, f"peer {args.peer}", args.vocab) if args.peer else None
    if args.vocab != COUNTING_VOCAB:
        ours = measure_at("HEAD", args, f"HEAD, vocabulary {args.vocab}", args.vocab)
    else:
        ours = measure(REPO, args, "this tree")
    line = f"path_bench /{args.route}: {ours:,.0f} delivered tok/s"
    if peer:
        line += f", peer {args.peer} {peer:,.0f} tok/s, {ours / peer:.2f}x"
    print(line)


if __name__ == "__main__":
    main()
