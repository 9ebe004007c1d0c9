"""``lightq rq-worker`` as a real process: batches, housekeeping, SIGTERM, and a batch that
resumes in the next rq-worker after the first was stopped in the middle of it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

from rq import Worker
from rq.registry import StartedJobRegistry

from producer.batches.rq_worker import queue
from tests.batches.helpers import completion_line, jsonl, output_lines, pool, wait_batch
from tests.waiting import MUST_HAPPEN_S


def start_rq_worker(rq_settings, log_path) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "lightq.cli",
        "rq-worker",
        "--redis_url",
        rq_settings.redis.url,
        "--redis_key_prefix",
        rq_settings.redis.key_prefix,
        "--batch_queue",
        rq_settings.batch.queue,
        "--housekeeping_queue",
        rq_settings.housekeeping.queue,
        "--housekeeping_interval_s",
        "1",
    ]
    log = open(log_path, "a")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def stop(process: subprocess.Popen, log_path) -> int:
    process.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(process.wait, 20)
    assert code == 0, open(log_path).read()[-3000:]
    return code


async def test_the_service_runs_batches_and_housekeeping_and_stops_at_once(
    client, worker, rq_settings, rq_conn, rq_names, rclient, keys, tmp_path
):
    log_path = tmp_path / "rq-worker.log"
    process = start_rq_worker(rq_settings, log_path)
    try:
        view = (await client.post("/v1/batches", content=jsonl(*[completion_line(f"r{i}") for i in range(3)]))).json()
        async with pool(worker) as taken:
            view = await wait_batch(client, view["id"], timeout_s=90)
        assert view["status"] == "completed", open(log_path).read()[-3000:]
        assert len(taken) == 3
        deadline = time.monotonic() + MUST_HAPPEN_S
        while rclient.xlen(keys.requests()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # housekeeping (every second here) trims the acknowledged entries
        assert rclient.xlen(keys.requests()) == 0
        assert len(Worker.all(queue=queue(rq_names.janitor, rq_conn))) == 1  # the housekeeping child
    finally:
        started = time.monotonic()
        await stop(process, log_path)
    assert time.monotonic() - started < 10
    assert Worker.all(queue=queue(rq_names.batch, rq_conn)) == []
    deadline = time.monotonic() + MUST_HAPPEN_S
    while Worker.all(queue=queue(rq_names.janitor, rq_conn)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert Worker.all(queue=queue(rq_names.janitor, rq_conn)) == []


async def test_a_batch_stopped_midway_resumes_in_the_next_rq_worker(
    client, worker, rq_settings, rq_conn, rq_names, tmp_path
):
    log_path = tmp_path / "rq-worker.log"
    batch = queue(rq_names.batch, rq_conn)
    view = (await client.post("/v1/batches", content=jsonl(*[completion_line(f"r{i}") for i in range(6)]))).json()
    [submitted] = batch.get_jobs()
    async with pool(worker, delay_s=0.15) as taken:
        process = start_rq_worker(rq_settings, log_path)
        try:
            for _ in range(600):
                view = (await client.get(f"/v1/batches/{view['id']}")).json()
                if view["request_counts"]["completed"] >= 2:
                    break
                await asyncio.sleep(0.1)
        finally:
            await stop(process, log_path)
        assert (await client.get(f"/v1/batches/{view['id']}")).json()["status"] == "in_progress"
        # Put back at once, its retries untouched: a clean stop is no crash. (It was left started
        # until its heartbeat lapsed, then retried: three clean restarts failed a batch.)
        assert StartedJobRegistry(queue=batch).get_job_ids(cleanup=False) == []
        assert batch.count == 1
        [job] = batch.get_jobs()
        assert job.id == submitted.id and job.retries_left == submitted.retries_left
        process = start_rq_worker(rq_settings, log_path)
        try:
            view = await wait_batch(client, view["id"], timeout_s=90)
        finally:
            await stop(process, log_path)
    assert view["status"] == "completed", open(log_path).read()[-3000:]
    assert view["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert len(taken) == 6  # nothing was sent twice
    out = output_lines((await client.get(f"/v1/batches/{view['id']}/output")).text)
    assert [line["custom_id"] for line in out] == [f"r{i}" for i in range(6)]
    assert len({line["response"]["request_id"] for line in out}) == 6


async def test_a_dead_housekeeping_child_ends_the_rq_worker_so_that_both_start_again(rq_settings, tmp_path):
    """Nothing started the janitor again, and the housekeeping stopped for good (acknowledged ingress
    entries piled up); now the rq worker ends with an error and its supervisor restarts both."""
    log_path = tmp_path / "rq-worker.log"
    process = start_rq_worker(rq_settings, log_path)
    try:
        deadline = time.monotonic() + MUST_HAPPEN_S
        janitor = None
        while janitor is None and time.monotonic() < deadline:
            children = open(f"/proc/{process.pid}/task/{process.pid}/children").read().split()
            janitor = int(children[0]) if children else None
            await asyncio.sleep(0.2)
        assert janitor is not None, open(log_path).read()[-3000:]
        await asyncio.sleep(2)  # its rq worker up
        os.kill(janitor, signal.SIGKILL)
        code = await asyncio.to_thread(process.wait, MUST_HAPPEN_S)
        # an error exit, or SIGTERM's own where rq's handlers were not in yet: a supervisor restarts either
        assert code != 0 and "the housekeeping child exited with -9" in open(log_path).read()
        # and rq's scheduler process, forked from the janitor, does not outlive it
        prefix = rq_settings.redis.key_prefix.encode()
        deadline = time.monotonic() + MUST_HAPPEN_S
        while (left := ours(prefix)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert not left
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def ours(prefix: bytes) -> list[int]:
    """Live processes whose command line names ``prefix`` (this test's rq worker and its children)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if prefix in f.read():
                    with open(f"/proc/{pid}/status") as status:
                        if "State:\tZ" not in status.read():
                            found.append(int(pid))
        except OSError:
            continue
    return found


def test_our_own_stop_is_not_taken_for_a_dead_janitor(monkeypatch):
    """At a stop, the main thread's join may reap the janitor before its watcher's join does; the
    watcher's then returns with exitcode None (waitpid's ECHILD). That once logged "the housekeeping
    child exited with None" as an error and signalled the worker (a CI failure of a quiet ctrl-c)."""
    import multiprocessing
    import threading

    from producer.batches import rq_worker

    janitor = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
    janitor.start()
    os.kill(janitor.pid, signal.SIGTERM)
    os.waitpid(janitor.pid, 0)  # reaped behind the Process object's back, as the main thread's join does
    signals: list = []
    monkeypatch.setattr(rq_worker.os, "kill", lambda pid, sig: signals.append((pid, sig)))
    lost, stopping = threading.Event(), threading.Event()
    stopping.set()
    rq_worker.watch_janitor(janitor, lost, stopping)
    assert janitor.exitcode is None  # the race's state, reproduced
    assert not lost.is_set() and signals == []
