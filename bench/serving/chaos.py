"""Chaos: concurrent streams while a worker and the router are killed (SIGKILL).

    python -m bench.serving.chaos --streams 200 --workers 3

``lightq serve`` on the deterministic counting model (every request's exact
output is known) with an append-only embedded Redis. After ``--kill-after``
seconds one worker and the router are killed; prints one line: streams,
how many came back exactly right, and how many had a missing, repeated or
wrong token.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile

import httpx

from shared.embedded_redis import start_embedded_redis
from tests.integration.stack import start_stack
from tests.integration.test_chaos import VOCAB, kill_a_worker_and_the_router, stream_one
from worker.model.counting_model import expected_tokens


async def run_streams(stack, count: int, kill_after: float) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=count + 50)) as client:
        chaos = asyncio.create_task(kill_a_worker_and_the_router(stack, kill_after))
        results = await asyncio.gather(*(stream_one(client, stack.http, [100 + i, 2000 + i]) for i in range(count)))
        await chaos
        return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kill-after", type=float, default=2.0)
    args = parser.parse_args()
    redis_server = start_embedded_redis(appendonly=True)
    stack = start_stack(
        f"{tempfile.mkdtemp()}/serve.log",
        redis_url=redis_server.url,
        prefix="lightq-chaos",
        workers=args.workers,
        extra=[
            "--model_dir",
            "counting",
            "--max_total_token_num",
            "60000",
            "--max_req_total_len",
            "1024",
            "--liveness_ttl_s",
            "1.5",
        ],
    )
    try:
        results = asyncio.run(run_streams(stack, args.streams, args.kill_after))
    finally:
        stack.stop()
        redis_server.stop()
    from tests.integration.test_chaos import NEW_TOKENS

    exact = sum(tokens == expected_tokens(2000 + i, NEW_TOKENS, VOCAB) for i, tokens in enumerate(results))
    print(
        f"chaos: {args.streams} streams, {args.workers} workers, a worker and the router killed after "
        f"{args.kill_after:.0f} s: {exact} exact, {args.streams - exact} with a missing, repeated or wrong token"
    )


if __name__ == "__main__":
    main()
