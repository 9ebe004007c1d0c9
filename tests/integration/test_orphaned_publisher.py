"""A killed worker's publisher outlives it and keeps writing: the pool's fence must refuse it (issue 29, item 5).

The red team's case: ``lightq serve --workers 2 --model_dir counting --max_attempts 1``, 16
submit-and-poll requests of 400 tokens, SIGKILL the busier worker mid-run. Its publisher process
(a child of its own) lives on for a while on a busy host and writes what it still holds: before
fencing, statuses went back from terminal to running, requests were left ``running`` with nobody
running them, dead letters did not end ``failed``, and a requeued dead letter did not replay
exactly.

Here the race is made certain: the publisher is stopped (SIGSTOP) as its worker is killed, the
router reaps the dead worker (its last admission dead-lettered, the rest requeued), and only then
is the publisher let go (SIGCONT) to write everything it held. Every write must be refused. Checked
from a watcher that samples every status hash all along: no terminal status ever changes, nothing
is left running, every dead letter is ``failed``, every chunk stream holds each index once, and
after ``lightq dead-letters requeue`` every request ends with exactly the counting model's tokens.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import psutil
import pytest

from lightq.dead_letters import list_dead, requeue_dead
from shared.chunks import parse_run
from shared.schemas import RequestStatus
from tests.integration.stack import start_stack
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens

NEW_TOKENS = 400
REQUESTS = 16
WAIT_S = 300  # a bound on waiting for what must happen, not a measurement
TERMINAL = {s.value for s in RequestStatus if s.is_terminal}


@pytest.fixture
def stack(tmp_path, redis_url):
    extra = ["--model_dir", "counting", "--max_attempts", "1", "--liveness_ttl_s", "1.5"]
    extra += ["--counting_step_ms", "10", "--max_total_token_num", "40000"]  # 400 tokens: ~4 s, killed mid-run
    stack = start_stack(
        str(tmp_path / "serve.log"),
        redis_url=redis_url,
        prefix=f"lightq-orphan-{uuid.uuid4().hex[:8]}",
        workers=2,
        extra=extra,
    )
    try:
        yield stack
    finally:
        try:
            stack.stop()
        finally:
            stack.remove_keys()


class Watcher(threading.Thread):
    """Samples every request's status every few ms; ``regressed`` lists a terminal status that changed."""

    def __init__(self, stack, ids: list[str]):
        super().__init__(daemon=True)
        self.client, self.keys, self.ids = stack.client(), stack.keys, ids
        self.seen: dict[str, list[str]] = {rid: [] for rid in ids}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            pipe = self.client.pipeline(transaction=False)
            for rid in self.ids:
                pipe.hget(self.keys.meta(rid), "status")
            for rid, status in zip(self.ids, pipe.execute()):
                if status is not None and (not self.seen[rid] or self.seen[rid][-1] != status):
                    self.seen[rid].append(status)
            time.sleep(0.005)

    def regressed(self) -> dict[str, list[str]]:
        """Requests whose status changed after being terminal (a dead letter's operator requeue aside)."""
        return {rid: s for rid, s in self.seen.items() if any(a in TERMINAL and b != a for a, b in zip(s, s[1:]))}


def statuses(stack, ids: list[str]) -> dict[str, str]:
    client = stack.client()
    return {rid: client.hget(stack.keys.meta(rid), "status") for rid in ids}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def written(stack, rid: str) -> list[tuple[int, int]]:
    """Every (index, token) the stream holds, in order, repeats included."""
    found = stack.client().xrange(stack.keys.chunks(rid))
    return [(c.index, c.token_id) for _, f in found for c in parse_run(f).tokens() if c.token_id is not None]


def test_an_orphaned_publishers_writes_are_refused_and_nothing_regresses(stack):
    prompts = [[100 + i] for i in range(REQUESTS)]
    body = {"parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    ids = [
        httpx.post(f"{stack.http}/v1/requests", json={"inputs": p, **body}, timeout=30).json()["id"] for p in prompts
    ]
    watcher = Watcher(stack, ids)
    watcher.start()
    client = stack.client()
    wait_until(lambda: sum(s == "running" for s in statuses(stack, ids).values()) >= REQUESTS // 2, "nothing ran")
    time.sleep(1.0)
    held: dict[str, int] = {}
    for rid in ids:
        worker = client.hget(stack.keys.meta(rid), "worker")
        held[worker] = held.get(worker, 0) + 1
    victim = max((w for w in held if w), key=held.get)
    worker = psutil.Process(int(victim.rsplit("-", 1)[1]))
    publishers = worker.children()
    assert publishers, "the worker's publisher processes"
    for p in publishers:
        p.send_signal(signal.SIGSTOP)
    os.kill(worker.pid, signal.SIGKILL)
    on_victim = [rid for rid in ids if client.hget(stack.keys.meta(rid), "worker") == victim]
    # The router reaps the dead worker: each of its requests is requeued or dead-lettered.
    wait_until(lambda: client.zscore(stack.keys.workers(), victim) is None, "the dead worker was not reaped")
    wait_until(
        lambda: all(
            client.hget(stack.keys.meta(r), "worker") != victim or client.hget(stack.keys.meta(r), "status") in TERMINAL
            for r in on_victim
        ),
        "the dead worker's requests were not taken back",
    )
    for p in publishers:  # the orphans write everything they held, now that the pool moved on
        p.send_signal(signal.SIGCONT)
    for p in publishers:
        p.wait(timeout=60)
    wait_until(lambda: all(s in TERMINAL for s in statuses(stack, ids).values()), "requests still not ended")
    time.sleep(0.5)  # a late stale write would show in the watcher now
    final = statuses(stack, ids)
    dead = {letter.request.id for _, letter in list_dead(client, stack.keys) if letter.request}
    assert dead, "the killed worker's last admission is dead-lettered (--max_attempts 1)"
    assert all(final[rid] == "failed" for rid in dead)
    assert all(final[rid] == "finished" for rid in ids if rid not in dead)
    assert watcher.regressed() == {}
    for rid in ids:  # no index written twice: the orphan's writes never landed
        indexes = [index for index, _ in written(stack, rid)]
        assert indexes == list(range(len(indexes))), rid
    # Requeued, the dead letters replay exactly: each index once, every token the counting model's.
    watcher.stop_event.set()
    assert requeue_dead(client, stack.keys, [], ttl_s=600) == len(dead)
    wait_until(
        lambda: all(s == "finished" for s in statuses(stack, ids).values()), "requeued dead letters did not finish"
    )
    for rid, prompt in zip(ids, prompts):
        expected = expected_tokens(prompt[-1], NEW_TOKENS, COUNTING_VOCAB)
        assert written(stack, rid) == list(enumerate(expected)), rid
