"""The publisher processes' watchdog (``PublisherLink._watch``), real processes and a real Redis: a
publisher that is alive but writes nothing (frozen by SIGSTOP here; hung on a dead connection in
the wild) is killed once it has left steps unwritten for ``--publisher_stall_s`` while Redis
answers, so that the worker finds it dead and hands its requests back (before, the worker's
heartbeat went on saying all is well and the requests stalled for ever); one that is merely idle
is left alone."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shared.worker_settings import WorkerSettings
from tests.waiting import MUST_HAPPEN_S
from tests.worker.test_publisher import started, tokenizer_only
from worker.service.publisher_process import WATCH_PERIOD_S, PublisherDied, PublisherLink

STALL_S = 1.0


@pytest.fixture
def link(redis_settings, smollm2_tokenizer_dir):
    settings = WorkerSettings(
        redis=redis_settings, publishers=2, publisher_stall_s=STALL_S, model=tokenizer_only(smollm2_tokenizer_dir)
    )
    link = PublisherLink(settings, "w1")
    link.start()
    link.wait_ready()
    yield link
    for shard in link.shards:
        if shard.process.is_alive():
            os.kill(shard.process.pid, signal.SIGCONT)
    link.close()


def test_a_frozen_publisher_is_killed_and_reported_dead(link):
    frozen, other = link.shards
    os.kill(frozen.process.pid, signal.SIGSTOP)
    link.put([started()])  # a step it never takes
    deadline = time.monotonic() + MUST_HAPPEN_S
    while True:
        try:
            link.check()
        except PublisherDied:
            break
        assert time.monotonic() < deadline, "a frozen publisher must be found and killed"
        time.sleep(0.2)
    assert frozen.process.exitcode == -signal.SIGKILL
    assert other.process.is_alive()  # it wrote its steps: not stalled


def test_an_idle_or_busy_publisher_is_left_alone(link):
    """Idle (every step written) for several stall times, then a step now and then: never killed."""
    time.sleep(3 * STALL_S + 2 * WATCH_PERIOD_S)
    for _ in range(5):
        link.put([started()])
        time.sleep(STALL_S / 2)
    link.check()
    assert all(shard.process.is_alive() for shard in link.shards)
    assert [shard.sent for shard in link.shards] == [5, 5]
