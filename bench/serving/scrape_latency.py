"""How long ``/metrics`` and ``/dashboard/data`` take at the peak of a burst.

``python -m bench.serving.scrape_latency [--queued 1000] [--scrapes 100]`` fills a
fresh key prefix of the Redis at ``LIGHTQ_REDIS_URL`` with what a burst
leaves there at its peak (``--queued`` requests in the ingress stream, none
dispatched, 140-token prompts, a status hash each), serves the producer app
with uvicorn in this process, and times ``--scrapes`` GETs of each route
while the app's cluster-view thread reads the view every second.
A static page (``/dashboard``) timed the same way shows what the machine
itself adds. It also times reads of the cluster view: cold (a reader that
keeps nothing, what every scrape awaited before the view moved off the
request path) and warm (the app's thread, which parsed the queued entries
before). One line per number; the prefix is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import httpx
import uvicorn

from producer.api.submit import new_request
from producer.app import create_app
from producer.monitoring.metrics import ProducerMetrics
from shared import codec
from shared.config import ModelSettings, RedisSettings
from shared.embedded_redis import free_port
from shared.keys import Keys
from shared.producer_settings import ProducerSettings
from shared.redis import async_client
from shared.schemas import RequestMeta, RequestStatus, SamplingParams


async def fill(redis, keys: Keys, queued: int) -> None:
    pipe = redis.pipeline(transaction=False)
    for n in range(queued):
        request = new_request(list(range(1, 141)), SamplingParams(max_new_tokens=256))
        pipe.hset(
            keys.meta(request.id),
            mapping=RequestMeta.fields(
                status=RequestStatus.QUEUED, prompt_tokens=140, max_new_tokens=256, created_ms=request.created_ms
            ),
        )
        pipe.xadd(keys.requests(), {codec.FIELD: codec.encode(request), "tokens_before": n * 396})
    await pipe.execute()


async def timed_gets(url: str, path: str, count: int) -> list[float]:
    times = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for _ in range(count):
            start = time.perf_counter()
            response = await client.get(path)
            times.append(time.perf_counter() - start)
            assert response.status_code == 200, response.text
            await asyncio.sleep(0.02)
    return times


def line(name: str, times: list[float]) -> str:
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    slow = sum(t > 0.1 for t in times)
    return (
        f"{name}: n={len(times)} median {1000 * statistics.median(times):.1f} ms, "
        f"p99 {1000 * p99:.1f} ms, max {1000 * ordered[-1]:.1f} ms, over 100 ms: {slow}"
    )


async def main(queued: int, scrapes: int) -> None:
    redis_settings = RedisSettings(key_prefix=f"lightq-scrape-bench-{uuid.uuid4().hex[:8]}")
    settings = ProducerSettings(redis=redis_settings, model=ModelSettings(model_dir="counting"))
    keys, redis = redis_settings.keys, async_client(redis_settings)
    port = free_port()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    try:
        await fill(redis, keys, queued)
        while not server.started:
            await asyncio.sleep(0.05)
        cold = []
        for _ in range(3):  # a reader that keeps nothing: what each scrape awaited before
            start = time.perf_counter()
            await ProducerMetrics().refresh(redis, keys)
            cold.append(time.perf_counter() - start)
        print(
            line(
                f"cluster-view read, cold ({queued} queued, each entry parsed; each scrape awaited this "
                f"before the view left the request path)",
                cold,
            )
        )
        warm = []
        for _ in range(5):
            start = time.perf_counter()
            await app.state.cluster_view.refresh_now()  # on the view's thread, as every second
            warm.append(time.perf_counter() - start)
        print(line("cluster-view read, warm (on its thread, queued entries parsed before)", warm))
        url = f"http://127.0.0.1:{port}"
        print(line("GET /metrics", await timed_gets(url, "/metrics", scrapes)))
        print(line("GET /dashboard/data", await timed_gets(url, "/dashboard/data", scrapes)))
        print(line("GET /dashboard (a static page: the machine's noise)", await timed_gets(url, "/dashboard", scrapes)))
    finally:
        server.should_exit = True
        await task
        found = [key async for key in redis.scan_iter(match=f"{keys.prefix}:*", count=1000)]
        if found:
            await redis.delete(*found)
        await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(main(args.queued, args.scrapes))
