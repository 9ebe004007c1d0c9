"""What ``lightq serve`` counts as a worker's start-up failure (issue 34, item 1): an error exit before
its heartbeat first reached the pool's registry. After that, routers may have sent it requests, so an
error exit may be a request's doing: it is restarted, however often (a request that keeps killing
workers is dead-lettered). Real child processes, a real Redis; the whole pool in test_poison_request.py."""

from __future__ import annotations

import subprocess
import sys
import time

from lightq.children import Child, RestartPolicy, failed_at_start_up
from lightq.launcher import Readiness


def child(role: str = "worker", env: dict[str, str] | None = None) -> Child:
    """A real child that waits for a line on its stdin, then exits with that code."""
    code = "import sys; sys.exit(int(sys.stdin.readline()))"
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, text=True)
    return Child(role, env or {}, process)


def exit_with(c: Child, code: int) -> Child:
    c.process.communicate(f"{code}\n")
    return c


def readiness(redis_settings) -> Readiness:
    flags = {"redis_url": redis_settings.url, "redis_key_prefix": redis_settings.key_prefix}
    return Readiness(redis_settings.url, flags, num_workers=1)


def beat(rclient, keys, worker_id: str, at_ms: int) -> None:
    """What a worker's heartbeat writes to the registry (worker.service.heartbeat.Heartbeat.beat)."""
    rclient.zadd(keys.workers(), {worker_id: at_ms})


def test_a_worker_is_ready_once_its_own_beat_is_in_the_registry(redis_settings, rclient, keys):
    ready, fresh, other = child(), child(), child()
    checker = readiness(redis_settings)
    checker.mark([ready, fresh, other])
    assert not any(c.ready for c in (ready, fresh, other))  # no beat yet
    beat(rclient, keys, ready.worker_id(), ready.started_ms)
    beat(rclient, keys, "some-other-worker", ready.started_ms)
    checker.mark([ready, fresh, other])
    assert ready.ready and not fresh.ready and not other.ready
    for c in (ready, fresh, other):
        exit_with(c, 1)


def test_an_earlier_process_beat_under_the_same_worker_id_is_not_this_ones(redis_settings, rclient, keys):
    c = child(env={"LIGHTQ_WORKER_ID": "fixed-id"})
    assert c.worker_id() == "fixed-id"
    beat(rclient, keys, "fixed-id", c.started_ms - 1)  # the record of the process it replaces
    checker = readiness(redis_settings)
    checker.mark([c])
    assert not c.ready
    beat(rclient, keys, "fixed-id", int(time.time() * 1000) + 1)
    checker.mark([c])
    assert c.ready
    exit_with(c, 1)


def test_only_error_exits_before_ready_count_toward_giving_up(redis_settings, rclient, keys):
    policy, now = RestartPolicy(), time.monotonic()
    checker = readiness(redis_settings)
    delays = []
    for i in range(6):  # six deaths while serving, in a row: restarted each time, backing off
        c = child()
        beat(rclient, keys, c.worker_id(), c.started_ms)
        checker.mark([c])
        exit_with(c, 70)
        assert not failed_at_start_up(c, now + i)
        delays.append(policy.delay(c, now + i))
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    # Long after the start, an error exit of a worker that never beat is still a start-up failure
    # (a model that takes minutes to load and then fails); three in a row end serve.
    late = now + 3600
    assert [policy.delay(exit_with(child(), 1), late + i) for i in range(3)] == [0.5, 1.0, None]


def test_other_roles_keep_the_time_rule():
    c = exit_with(child("router"), 1)
    assert failed_at_start_up(c, c.started + 1) and not failed_at_start_up(c, c.started + 3600)
    assert not failed_at_start_up(exit_with(child("worker"), 0), time.monotonic())  # a clean exit
