"""``--producers N``: N real processes behind one port, their counters and histograms summed
in every process's /metrics, a clean stop on SIGTERM; the settings travel through the environment."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from producer.main import settings_env
from shared.config import BatchSettings, ModelSettings, RedisSettings
from shared.embedded_redis import free_port
from shared.flags import build
from shared.producer_settings import ProducerSettings
from tests.monitoring.conftest import parse

PRODUCERS = 2
REQUESTS = 10
BODY = {"inputs": [1, 2, 3], "parameters": {"max_new_tokens": 3}}


def test_settings_travel_through_the_environment(monkeypatch):
    settings = ProducerSettings(
        redis=RedisSettings(url="redis://127.0.0.1:1/2", key_prefix="elsewhere"),
        model=ModelSettings(model_dir="counting", max_req_total_len=99),
        port=1234,
        producers=3,
        api_keys="key-a,key-b",
        reject_without_workers=True,
        stream_block_ms=7,
        metrics_refresh_s=0.5,
        batch=BatchSettings(max_in_flight=5),
    )
    for name in [name for name in os.environ if name.startswith("LIGHTQ_")]:
        monkeypatch.delenv(name)
    for name, value in settings_env(settings).items():
        monkeypatch.setenv(name, value)
    assert build(ProducerSettings, {}) == settings  # the secret too, not its '**********'


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("PPid:")).split()[1])


async def each_process(url: str, path: str) -> dict[int, httpx.Response]:
    """GET ``path`` on fresh connections until every process answered once: pid -> its answer."""
    answers: dict[int, httpx.Response] = {}
    deadline = time.monotonic() + 180  # a bound on the wait, not a measurement (a loaded 2-core machine: 60 s ran out)
    while len(answers) < PRODUCERS:
        assert time.monotonic() < deadline, f"only processes {sorted(answers)} answered"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:  # a new connection each time
                response = await client.get(path)
        except httpx.TransportError:  # not listening yet
            await asyncio.sleep(0.1)
            continue
        if response.status_code == 200:
            answers[int(response.headers["X-Lightq-Pid"])] = response
    return answers


@pytest.fixture
def producers(redis_settings, tmp_path, smollm2_tokenizer_dir):
    """``python -m producer.main --producers 2`` on a free port, its temp files under ``tmp_path``;
    its model SmolLM2's tokenizer as a directory (tests/conftest.py: what ``counting`` loads, in a
    fraction of the time each process takes to build it from the GGUF)."""
    port = free_port()
    env = {name: value for name, value in os.environ.items() if not name.startswith("LIGHTQ_")}
    env.update(
        TMPDIR=str(tmp_path), LIGHTQ_REDIS_URL=redis_settings.url, LIGHTQ_REDIS_KEY_PREFIX=redis_settings.key_prefix
    )
    log = open(tmp_path / "producer.log", "w")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producer.main",
            "--producers",
            str(PRODUCERS),
            "--port",
            str(port),
            "--model_dir",
            smollm2_tokenizer_dir,
            "--stream_block_ms",
            "100",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    yield process, f"http://127.0.0.1:{port}"
    try:  # a test that failed half-way: the whole group, or the children outlive a killed parent
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(10)
    log.close()


async def test_two_processes_one_port_metrics_summed_clean_stop(producers, worker, tmp_path):
    process, url = producers
    health = await each_process(url, "/health")
    assert all(parent_of(pid) == process.pid for pid in health)  # two children of the one parent

    async def serve() -> None:
        for _ in range(REQUESTS):
            await worker.generate(await worker.take(timeout_s=60), ["a", "b", "c"])

    async def generate() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:  # spread over the processes
            return await client.post("/generate", json=BODY)

    server = asyncio.create_task(serve())
    responses = await asyncio.gather(*(generate() for _ in range(REQUESTS)))
    await server
    assert [r.status_code for r in responses] == [200] * REQUESTS
    for pid, response in (await each_process(url, "/metrics")).items():
        samples = parse(response.text)
        assert samples[("lightq:time_to_first_token_seconds_count", ())] == REQUESTS, pid
        assert samples[("lightq:e2e_request_latency_seconds_count", ())] == REQUESTS, pid
        assert samples[("lightq:requests_accepted_total", (("route", "generate"),))] == REQUESTS, pid
        assert ("lightq:ingress_queue_depth", ()) in samples, pid  # each process serves its own cluster view

    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 0, (tmp_path / "producer.log").read_text()[-3000:]
    for pid in health:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("lightq-producer-metrics-")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/status") as status:  # a zombie not yet reaped by init is gone too
        return any(line.startswith("State:") and "Z" in line for line in status)


async def test_children_stop_when_their_supervisor_is_killed(producers):
    process, url = producers
    children = list(await each_process(url, "/health"))
    process.kill()  # SIGKILL: the supervisor can stop nobody
    process.wait(10)
    deadline = time.monotonic() + 30  # a bound on the wait (their graceful stop), not a measurement
    while not all(gone(pid) for pid in children):
        assert time.monotonic() < deadline, "children outlived their supervisor (and keep the port)"
        await asyncio.sleep(0.1)
