"""What the batch tests share: the in-thread rq worker, batch-file lines, waiting for a batch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import httpx
from rq import SimpleWorker
from rq.timeouts import TimerDeathPenalty

from producer.batches.rq_worker import QuickUnsubscribe
from shared.schemas import GenerateRequest, RequestStatus
from tests.producer.fake_worker import FakeWorker, stop_task
from tests.waiting import MUST_HAPPEN_S

MODEL = "default"  # the served model answers to its --model_dir too


class ThreadWorker(QuickUnsubscribe, SimpleWorker):
    """rq's in-process worker, runnable off the main thread (no signal handlers, timer timeouts).
    Its teardown waits at most 1 s for rq's pubsub thread, as lightq's own rq workers do
    (``QuickUnsubscribe``: with redis-py 8 a burst run could otherwise end 60 s after its work)."""

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass


def jsonl(*lines: dict) -> str:
    return "".join(json.dumps(line) + "\n" for line in lines)


def completion_line(custom_id: str, prompt: str = "Hello", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": prompt, "max_tokens": 4, **body},
    }


def chat_line(custom_id: str, text: str = "Hi") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4},
    }


def generate_line(custom_id: str, text: str = "What is AI?") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/generate",
        "body": {"inputs": text, "parameters": {"max_new_tokens": 4}},
    }


async def wait_batch(
    client: httpx.AsyncClient,
    batch_id: str,
    done=("completed", "failed", "cancelled"),
    timeout_s: float = MUST_HAPPEN_S,
) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        view = (await client.get(f"/v1/batches/{batch_id}")).json()
        if view["status"] in done or time.monotonic() > deadline:
            return view
        await asyncio.sleep(0.05)


def output_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


@contextlib.asynccontextmanager
async def pool(
    worker: FakeWorker,
    *,
    texts=(" a", " b"),
    fail_max_new: int | None = None,
    poison_max_new: int | None = None,
    delay_s: float = 0.0,
    seen: list | None = None,
) -> AsyncIterator[list[GenerateRequest]]:
    """The fake worker answers every request (``texts``); one with ``max_new_tokens == fail_max_new`` fails;
    one with ``poison_max_new`` gets an entry no reader takes (a null top logprob) before its answer."""
    taken: list[GenerateRequest] = [] if seen is None else seen

    stop = asyncio.Event()

    async def serve() -> None:
        while not stop.is_set():
            try:
                request = await worker.take(timeout_s=0.3)
            except TimeoutError:
                continue
            taken.append(request)
            if request.params.max_new_tokens == poison_max_new:
                fields = {"request_id": request.id, "token_ids": [5], "texts": ["a"], "logprobs": [-1.0]}
                bad = {"kind": "run", "v": 2, "choice": 0, "index": 0, **fields, "top_logprobs": [[[5, None]]]}
                await worker.redis.xadd(worker.keys.chunks(request.id), {"msg": json.dumps(bad)})
            if request.params.max_new_tokens == fail_max_new:
                await worker.end(request.id, 0, RequestStatus.FAILED, "error", error="the worker broke")
            else:
                await worker.generate(request, list(texts), finish_reason="length", delay_s=delay_s)

    task = asyncio.create_task(serve())
    try:
        yield taken
    finally:
        await stop_task(task, stop)
