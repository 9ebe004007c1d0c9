"""One key floods the queue, another sends one request behind it: how long the second waits.

    .venv/bin/python -m bench.serving.tenant_flood                   # this tree
    .venv/bin/python -m bench.serving.tenant_flood --peer 0652da6    # an older commit first, same run

Fair shares (``router/order/ordering.py``) promise a tenant that sends little the next free slot while
another floods. They order only what a router has read, and a router read at most ``--order_window``
(1,024) entries of a class ahead, so a flood longer than that hid everyone behind it until it
drained (``router/order/parking.py`` reads on past it). This runs ``lightq serve`` on the counting model
(two workers of 4,096 tokens, 20 ms a step, so a flood takes minutes), queues ``--flood`` requests of
200 tokens from key ``tb`` through 64 concurrent clients, then one of 5 tokens from key ``ta``, and
times ``ta``'s from submission to its end. One line a tree:

    tenant_flood: 2000 of tb queued, then ta's: finished after 0.3 s (peer 0652da6: 105.1 s)
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.serving.path_bench import REPO, peer_tree, start_serve
from shared.embedded_redis import start_embedded_redis

FLAGS = ["--model_dir", "counting", "--workers", "2", "--api_keys", "ta:sk-a,tb:sk-b"]
FLAGS += ["--max_total_token_num", "4096", "--counting_step_ms", "20"]
A, B = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
ENDED = ("finished", "failed", "cancelled", "expired")


async def flood_then_one(http: str, flood: int) -> tuple[str, float]:
    async with httpx.AsyncClient(base_url=http, timeout=60) as client:
        slots = asyncio.Semaphore(64)

        async def one(i: int) -> None:
            async with slots:
                body = {"inputs": [i % 4000 + 1], "parameters": {"max_new_tokens": 200}}
                reply = await client.post("/v1/requests", headers=B, json=body)
                assert reply.status_code == 202, reply.text

        await asyncio.gather(*(one(i) for i in range(flood)))
        started = time.perf_counter()
        reply = await client.post("/v1/requests", headers=A, json={"inputs": [7], "parameters": {"max_new_tokens": 5}})
        request_id = reply.json()["id"]
        while (status := (await client.get(f"/v1/requests/{request_id}", headers=A)).json()["status"]) not in ENDED:
            await asyncio.sleep(0.05)
        return status, time.perf_counter() - started


def measure(tree: Path, flood: int) -> tuple[str, float]:
    redis = start_embedded_redis()
    log = Path(tempfile.mkdtemp(prefix="lightq-flood-")) / "serve.log"
    process, http = start_serve(tree, redis.url, log, [], FLAGS)
    try:
        return asyncio.run(flood_then_one(http, flood))
    finally:
        process.terminate()
        process.wait(60)
        redis.stop()
        shutil.rmtree(log.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=2000, help="key tb's requests queued first")
    parser.add_argument("--peer", help="an older commit (or a tree on disk) to run first, in the same run")
    args = parser.parse_args()
    peer = ""
    if args.peer:
        tree = peer_tree(args.peer)
        try:
            status, seconds = measure(tree, args.flood)
            peer = f" (peer {args.peer}: {status} after {seconds:.1f} s)"
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
            shutil.rmtree(tree, ignore_errors=True)
    status, seconds = measure(REPO, args.flood)
    print(f"tenant_flood: {args.flood} of tb queued, then ta's: {status} after {seconds:.1f} s{peer}")


if __name__ == "__main__":
    main()
