"""Chaos against real processes: ``lightq serve`` with 3 workers on the
deterministic counting model (``--model_dir counting``: next token = last + 1),
so every request's exact output is known in advance."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from shared.chunks import parse_run
from shared.embedded_redis import start_embedded_redis
from tests.integration.stack import start_stack
from tests.waiting import MUST_HAPPEN_S
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens

pytestmark = pytest.mark.slow

VOCAB = COUNTING_VOCAB
NEW_TOKENS = 200


@pytest.fixture
def redis_server():
    server = start_embedded_redis(appendonly=True)
    yield server
    server.stop()


@pytest.fixture
def stack(counting_trio_stack):
    """3 workers on the counting model (tests/integration/conftest.py's ``counting_trio``): one ``lightq serve``
    for the four tests below that use it and test_publisher_crash.py, each meeting a whole pool."""
    return counting_trio_stack


async def stream_one(client: httpx.AsyncClient, http: str, prompt: list[int]) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    tokens = []
    async with client.stream("POST", f"{http}/generate_stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                tokens.append(event["token"]["id"])
    return tokens


def pid_of(service_id: str) -> int:
    return int(service_id.rsplit("-", 1)[1])


def a_worker_mid_request(stack) -> str | None:
    """A live worker whose heartbeat shows it holds a request far from done, if any."""
    for worker, load in sorted(stack.live_workers().items()):
        if any(out < NEW_TOKENS // 2 for _, out, _, _ in load.requests):
            return worker
    return None


async def kill_a_worker_and_the_router(stack) -> None:
    """SIGKILL a worker that holds a request far from done, and every router, at once. It waits for
    such a worker rather than a fixed time: CI's machine once finished the whole burst before a
    fixed 2 s wait ran out, so nothing was killed mid-run."""
    deadline = time.monotonic() + MUST_HAPPEN_S
    while (worker := await asyncio.to_thread(a_worker_mid_request, stack)) is None:
        assert time.monotonic() < deadline, "no worker ever held a request"
        await asyncio.sleep(0.01)
    client = stack.client()
    routers = [
        k.split(":")[-2].strip("{}").removeprefix("rt:") for k in client.scan_iter(match=stack.keys.router_alive("*"))
    ]
    os.kill(pid_of(worker), signal.SIGKILL)
    for router in routers:
        os.kill(pid_of(router), signal.SIGKILL)
    client.close()


def test_killing_a_worker_and_the_router_mid_stream_loses_and_repeats_nothing(stack):
    prompts = [[100 + i, 2000 + i] for i in range(200)]

    async def run():
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            chaos = asyncio.create_task(kill_a_worker_and_the_router(stack))
            results = await asyncio.gather(*(stream_one(client, stack.http, p) for p in prompts))
            await chaos
            return results

    results = asyncio.run(run())
    for prompt, tokens in zip(prompts, results):
        assert tokens == expected_tokens(prompt[-1], NEW_TOKENS, VOCAB)
    # serve notices the deaths on its next look at its children, which may come after the streams end.
    deadline = time.monotonic() + MUST_HAPPEN_S
    while stack.test_log().count("starting another") < 2:
        assert time.monotonic() < deadline, stack.test_log()[-2000:]
        time.sleep(0.1)


def test_redis_restart_mid_load_leaves_no_request_hanging(stack, counting_trio):
    redis_server = counting_trio.redis_server
    ids = []
    for i in range(60):
        body = {"inputs": [300 + i], "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        ids.append(httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30).json()["id"])
    time.sleep(1.0)
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    redis_server.stop(keep_data=True)
    time.sleep(2.0)
    restarted = start_embedded_redis(port=port, appendonly=True, workdir=redis_server.workdir)
    redis_server.process = restarted.process
    deadline = time.monotonic() + MUST_HAPPEN_S
    final = {}
    while len(final) < len(ids) and time.monotonic() < deadline:
        for request_id in ids:
            if request_id in final:
                continue
            response = httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10)
            if response.status_code == 200 and response.json()["status"] not in ("queued", "running"):
                final[request_id] = response.json()
        time.sleep(0.5)
    assert len(final) == len(ids), f"{len(ids) - len(final)} requests still not final after a Redis restart"
    finished = [f for f in final.values() if f["status"] == "finished"]
    assert all(f["output_tokens"] == NEW_TOKENS for f in finished)
    assert len(finished) == len(ids)  # with append-only persistence nothing is lost


def a_worker_with_a_young_request(stack, request_ids: list[str], young: int) -> str | None:
    """A worker running one of ``request_ids`` that has emitted fewer than ``young`` tokens (its status
    hash says where it runs, its chunk stream's last run how far it is), read in one round trip."""
    client = stack.client()
    try:
        pipe = client.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.hmget(stack.keys.meta(request_id), "status", "worker")
            pipe.xrevrange(stack.keys.chunks(request_id), count=1)
        replies = pipe.execute()
    finally:
        client.close()
    for (status, worker), last in zip(replies[::2], replies[1::2]):
        run = parse_run(last[0][1]) if last else None
        if status == "running" and worker and (run is None or run.index + len(run.token_ids) < young):
            return worker
    return None


def test_sigterm_drains_a_worker_and_hands_the_rest_back(stack):
    ids, prompts, new_tokens = [], [], 1000  # far more than the drain (DRAIN_TIMEOUT_S) can finish
    for i in range(40):
        prompts.append([500 + i])
        body = {"inputs": prompts[-1], "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}}
        ids.append(httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30).json()["id"])
    # Stop a worker that runs a request with fewer than a tenth of its tokens out, at once: the
    # 0.1 s drain cannot finish that one, so the rest must be handed back. The counting model makes
    # 1,000 tokens in 5 s or more (its 5 ms step: tests.integration.stack.COUNTING_STEP_MS); without
    # the step, a fixed wait, or a scan of 40 statuses over HTTP on a loaded
    # machine, let everything finish before the signal (CI once saw that); a worker's heartbeat
    # (every 0.5 s) lagged a quiet machine's run; and a request merely started could be half done
    # when its status said so, and end within the drain (both seen in full runs).
    deadline = time.monotonic() + MUST_HAPPEN_S
    while (victim := a_worker_with_a_young_request(stack, ids, new_tokens // 10)) is None:
        assert time.monotonic() < deadline, "no worker ran a young request"
        time.sleep(0.005)
    os.kill(pid_of(victim), signal.SIGTERM)
    finals = []
    for request_id in ids:
        deadline = time.monotonic() + MUST_HAPPEN_S
        while (status := httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json())["status"] in (
            "queued",
            "running",
        ):
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        finals.append(status)
    assert all(f["status"] == "finished" and f["output_tokens"] == new_tokens for f in finals)
    deadline = time.monotonic() + MUST_HAPPEN_S
    while f"(pid {pid_of(victim)}) exited with 0" not in (log := stack.test_log()):
        assert time.monotonic() < deadline, "a drained worker must exit with 0"
        time.sleep(0.5)
    assert f"worker {victim} draining" in log
    assert f"worker {victim} handed" in log  # the drain is too short for 1,000 tokens: the rest went back


def child_pid(parent: int, role: str) -> int:
    """The pid of ``lightq serve``'s child running ``role``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline").read().split("\0")
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == parent and cmdline[-2:] == [role, ""] and "lightq.cli" in cmdline:
            return int(entry)
    raise LookupError(f"no {role} under pid {parent}")


def wait_finished(http: str, request_id: str, timeout_s: float = MUST_HAPPEN_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            status = httpx.get(f"{http}/v1/requests/{request_id}", timeout=5).json()
            if status["status"] not in ("queued", "running"):
                return status
        except httpx.HTTPError:  # the producer is being replaced
            pass
        assert time.monotonic() < deadline, f"{request_id} never finished"
        time.sleep(0.3)


def test_killing_the_producer_loses_no_request(stack):
    ids = []
    for i in range(50):
        body = {"inputs": [700 + i], "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
        ids.append(httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30).json()["id"])
    os.kill(child_pid(stack.process.pid, "producer"), signal.SIGKILL)
    finals = [wait_finished(stack.http, request_id) for request_id in ids]
    assert all(f["status"] == "finished" and f["output_tokens"] == NEW_TOKENS for f in finals)
    with httpx.stream("GET", f"{stack.http}/v1/requests/{ids[0]}/stream", timeout=30) as response:
        indexes = [json.loads(line[5:])["index"] for line in response.iter_lines() if line.startswith("data:")]
    assert indexes == list(range(NEW_TOKENS))
    assert "producer (pid" in stack.test_log()


@pytest.fixture(params=["node", "cluster"])
def backend(request, redis_server) -> tuple[str, list[str]]:
    """The Redis URL and serve flags of a stack of its own: a fresh embedded node, or the session's 3+3
    cluster, whole and flushed (``clean_cluster``), with rq's queue on the node as a cluster
    deployment has it (issue 30: the backlog's 429 and the tight pools on both)."""
    if request.param == "node":
        return redis_server.url, []
    return request.getfixturevalue("clean_cluster").url, ["--redis_rq_url", redis_server.url]


@pytest.fixture
def small_backlog_stack(backend, tmp_path):
    url, flags = backend
    stack = start_stack(
        str(tmp_path / "serve.log"),
        redis_url=url,
        prefix="lightq-burst",
        workers=1,
        extra=["--model_dir", "counting", "--max_total_token_num", "60000", "--max_queue_tokens", "2000", *flags],
    )
    yield stack
    stack.stop()


def test_a_burst_past_the_backlog_gets_429_and_every_accepted_request_completes(small_backlog_stack):
    http = small_backlog_stack.http

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            body = lambda i: {"inputs": [900 + i], "parameters": {"max_new_tokens": 100, "ignore_eos": True}}  # noqa
            return await asyncio.gather(*(client.post(f"{http}/v1/requests", json=body(i)) for i in range(80)))

    responses = asyncio.run(burst())
    accepted = [r.json()["id"] for r in responses if r.status_code == 202]
    refused = [r for r in responses if r.status_code == 429]
    assert accepted and refused and len(accepted) + len(refused) == 80
    assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full" for r in refused)
    finals = [wait_finished(http, request_id) for request_id in accepted]
    assert all(f["status"] == "finished" and f["output_tokens"] == 100 for f in finals)


@pytest.fixture
def tight_pool_stack(backend, tmp_path):
    # Pools far smaller than the burst's conservative need: past-future admission (the
    # default) and the workers' pausing must carry it without running out of KV tokens.
    url, flags = backend
    stack = start_stack(
        str(tmp_path / "serve.log"),
        redis_url=url,
        prefix="lightq-tight",
        workers=2,
        extra=[
            "--model_dir",
            "counting",
            "--max_total_token_num",
            "3000",
            "--max_req_total_len",
            "1024",
            "--history_prior",
            "50",
            *flags,
        ],
    )
    yield stack
    stack.stop()


def test_a_mixed_burst_on_tight_pools_finishes_exactly(tight_pool_stack):
    http = tight_pool_stack.http
    lengths = [20, 900, 60, 400, 5, 700, 150, 30] * 5  # mixed output lengths, 40 requests

    async def burst():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=60)) as client:
            return await asyncio.gather(*(stream_length(client, http, [1200 + i], n) for i, n in enumerate(lengths)))

    async def stream_length(client, http, prompt, n):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": False}}
        async with client.stream("POST", f"{http}/generate_stream", json=body) as response:
            assert response.status_code == 200
            return [
                json.loads(line[5:])["token"]["id"] async for line in response.aiter_lines() if line.startswith("data:")
            ]

    results = asyncio.run(burst())
    for i, (n, tokens) in enumerate(zip(lengths, results)):
        assert tokens == expected_tokens(1200 + i, n, VOCAB), i
    log = open(tight_pool_stack.log_path).read()
    assert "Traceback" not in log and "exited with" not in log  # no worker ran out of KV tokens
    assert "to free KV slots" in log  # estimates were short: pausing, not luck, carried the burst
