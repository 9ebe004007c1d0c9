"""Load: N requests as fast as the producer takes them; none may be lost.

    python -m bench.serving.load --requests 5000 --workers 4

Starts ``lightq serve`` on the counting model (no model cost: this measures
the queue path) with an embedded Redis, submits every request through
``POST /v1/requests`` from a pool of concurrent clients, waits until each
request's status is final, and prints one line: accepted/s, lost requests,
and the router's added latency (enqueue -> dispatch, from each request's
status hash) at p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time

import httpx
import numpy as np
from tqdm import tqdm

from shared.embedded_redis import start_embedded_redis
from shared.schemas import RequestMeta
from tests.integration.stack import Stack, start_stack


async def submit_all(http: str, count: int, concurrency: int, new_tokens: int) -> list[str]:
    ids: list[str] = []
    queue = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)
    bar = tqdm(total=count, unit="req", desc="submit", mininterval=1)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            body = {"inputs": [100 + i % 40000], "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
            response = await post_retrying(client, f"{http}/v1/requests", body)
            response.raise_for_status()
            ids.append(response.json()["id"])
            bar.update()

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    bar.close()
    return ids


async def post_retrying(client: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    """POST, sent again once if the connection broke before an answer (a kept-alive connection
    the server closed as it was reused: seen once in CI on a loaded 2-core machine). A request
    the first try did enqueue is then not among the ids, so it is not counted, lost or not."""
    try:
        return await client.post(url, json=body)
    except (httpx.ReadError, httpx.RemoteProtocolError):
        return await client.post(url, json=body)


def wait_final(stack: Stack, ids: list[str], timeout_s: float) -> list[RequestMeta]:
    client = stack.client()
    deadline = time.monotonic() + timeout_s
    final: dict[str, RequestMeta] = {}
    with tqdm(total=len(ids), unit="req", desc="finish", mininterval=1) as bar:
        while len(final) < len(ids) and time.monotonic() < deadline:
            todo = [i for i in ids if i not in final]
            pipe = client.pipeline(transaction=False)
            for request_id in todo:
                pipe.hgetall(stack.keys.meta(request_id))
            for request_id, raw in zip(todo, pipe.execute()):
                if raw and RequestMeta.from_hash(raw).status.is_terminal:
                    final[request_id] = RequestMeta.from_hash(raw)
                    bar.update()
            time.sleep(0.2)
    client.close()
    return list(final.values())


def run(args) -> dict:
    redis_server = start_embedded_redis()
    folder = tempfile.mkdtemp(prefix="lightq-load-")
    stack = start_stack(
        f"{folder}/serve.log",
        redis_url=redis_server.url,
        prefix="lightq-load",
        workers=args.workers,
        extra=["--model_dir", "counting", "--max_total_token_num", "200000", "--running_max_req_size", "512"],
    )
    done = False
    try:
        start = time.perf_counter()
        ids = asyncio.run(submit_all(stack.http, args.requests, args.concurrency, args.new_tokens))
        accepted_s = time.perf_counter() - start
        finals = wait_final(stack, ids, args.timeout)
        done = True
    finally:
        stack.stop()
        redis_server.stop()
        if done:  # the pool's log is kept only when the run failed
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"load: the pool's log is {folder}/serve.log", file=sys.stderr)
    finished = [m for m in finals if m.status.value == "finished" and m.output_tokens == args.new_tokens]
    added = np.array([m.dispatched_ms - m.created_ms for m in finals if m.dispatched_ms])
    result = dict(
        requests=args.requests,
        accepted_per_s=len(ids) / accepted_s,
        lost=args.requests - len(finished),
        dispatch_p50_ms=float(np.percentile(added, 50)),
        dispatch_p99_ms=float(np.percentile(added, 99)),
    )
    print(
        f"load: {args.requests} requests, {args.workers} workers: {result['accepted_per_s']:.0f} accepted/s, "
        f"{result['lost']} lost, router added latency p50 {result['dispatch_p50_ms']:.0f} ms "
        f"p99 {result['dispatch_p99_ms']:.0f} ms"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
