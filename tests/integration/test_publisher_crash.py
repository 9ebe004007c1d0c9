"""A publisher process killed mid-stream, or frozen (SIGSTOP: alive, writing nothing, until its
worker's watchdog kills it after ``--publisher_stall_s``), real processes, counting model: its
worker hands its requests back and exits, they resume elsewhere, and every client stream carries
each index once, with exactly the tokens the model makes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.integration.test_chaos import pid_of
from tests.waiting import MUST_HAPPEN_S
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens

pytestmark = pytest.mark.slow

NEW_TOKENS = 600


@pytest.fixture
def stack(counting_trio_stack):
    """3 workers on the counting model, the chaos tests' stack (tests/integration/conftest.py's ``counting_trio``:
    a pool of its own cost one more start and stop of every process; a third worker changes nothing
    here: the victim is whichever worker is busy, and the rest resume its requests)."""
    return counting_trio_stack


def publisher_pids(worker_pid: int) -> list[int]:
    """The worker's publisher processes: its spawned children."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = open(f"/proc/{entry}/cmdline").read()
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == worker_pid and "multiprocessing.spawn" in cmdline:
            pids.append(int(entry))
    return pids


async def stream(client: httpx.AsyncClient, http: str, prompt: list[int]) -> list[int]:
    """The token id of every event, in arrival order."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    seen: list[int] = []
    async with client.stream("POST", f"{http}/generate_stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                seen.append(json.loads(line[5:])["token"]["id"])
    return seen


async def signal_a_publisher(stack, sig: signal.Signals) -> int:
    """Once some tokens are out, send ``sig`` to a publisher of a worker that runs something."""
    client = stack.client()
    deadline = time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline:
        busy = [w for w, load in stack.live_workers().items() if load.used_tokens]
        if busy:
            await asyncio.sleep(0.3)  # some tokens delivered first
            victim = pid_of(sorted(busy)[0])
            pids = publisher_pids(victim)
            assert pids, f"worker {victim} has no publisher process"
            os.kill(pids[0], sig)
            client.close()
            return victim
        await asyncio.sleep(0.02)
    raise AssertionError("no worker got busy")


async def run(stack, sig: signal.Signals) -> tuple[list[tuple[list[int], list[int]]], int]:
    prompts = [[1500 + i] for i in range(12)]
    async with httpx.AsyncClient(timeout=180) as client:
        streams = (stream(client, stack.http, p) for p in prompts)
        results = await asyncio.gather(*streams, signal_a_publisher(stack, sig))
    return list(zip(prompts, results[:-1])), results[-1]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_killed_or_frozen_publisher_loses_and_repeats_no_token(stack, sig):
    streams, victim = asyncio.run(run(stack, sig))
    for prompt, seen in streams:
        assert seen == expected_tokens(prompt[-1], NEW_TOKENS, COUNTING_VOCAB)
    # The streams may all end before the worker notices its publisher is gone (the others carried
    # its requests on): its word comes within the hang guard, not before the last token.
    deadline = time.monotonic() + MUST_HAPPEN_S
    while not ("publisher process" in (log := stack.test_log()) and "handing its requests back" in log):
        assert time.monotonic() < deadline, "the worker must say its publisher died and hand its requests back"
        time.sleep(0.5)
    while f"(pid {victim}) exited with 1" not in (log := stack.test_log()):
        assert time.monotonic() < deadline, "the worker of a dead publisher must exit with an error"
        time.sleep(0.5)
    if sig is signal.SIGSTOP:
        assert "while Redis answers: killed" in log  # the watchdog, not a death, ended it
