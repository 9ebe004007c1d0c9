"""The pool on a real Redis Cluster (3 primaries, 3 replicas: tests/cluster.py) with the counting model,
whose every token is known: the whole path, sharded pub/sub, a batch, a primary killed mid-burst (the
control plane's and a data plane's), a worker frozen past its liveness, and the chaos suite's
worker and router SIGKILLed mid-stream, its producer SIGKILLed, its SIGTERM drain and its Redis
restart (every node).
``tests.checker`` judges each burst (lost, duplicated, wrong) and the report line is printed with the
time the pool took to recover."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shared.chunks import parse_run
from tests.batches.helpers import generate_line, jsonl
from tests.checker import Burst, Report
from tests.integration import test_chaos as chaos
from tests.waiting import MUST_HAPPEN_S
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens


@pytest.fixture
def stack(counting_cluster_stack):
    return counting_cluster_stack


@pytest.fixture
def cluster(counting_cluster):
    return counting_cluster.cluster


def burst(stack, requests: int = 60, new_tokens: int = 80, first_token: int = 1000) -> Burst:
    done = Burst(stack.http, requests=requests, new_tokens=new_tokens, first_token=first_token)
    asyncio.run(done.run())
    return done


def clean(report: Report, refused_ok: bool = False) -> None:
    assert report.lost == 0 and report.duplicated == 0 and report.wrong == 0, report.line()
    assert refused_ok or report.refused == 0, report.line()
    assert report.ended == report.sent - report.refused, report.line()


def test_a_burst_on_the_cluster_is_served_exactly_and_its_data_spread_over_every_primary(stack, cluster):
    done = burst(stack, requests=80)
    report = done.check()
    print("cluster, whole path:", report.line())
    clean(report)
    prefix = stack.keys.prefix
    per_primary = [
        len(list(node.client().scan_iter(match=f"{prefix}:{{r*}}:*:chunks"))) for node in cluster.primary_nodes()
    ]
    assert all(count > 0 for count in per_primary), per_primary  # 24 request groups, 8 on each primary


def test_a_sharded_subscriber_hears_a_requests_runs_in_order(stack):
    """SSUBSCRIBE to a request's channel (sharded pub/sub: its group's node), as a listener from outside
    does on a cluster; it hears every run written after it subscribed, in order, and the last one ends it."""
    body = {"inputs": [1, 77], "parameters": {"max_new_tokens": 1000, "ignore_eos": True}}
    request_id = httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30).json()["id"]
    client = stack.client()
    pubsub = client.pubsub()
    pubsub.ssubscribe(stack.keys.channel(request_id))
    runs, deadline = [], time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline and not (runs and runs[-1].finished):
        message = pubsub.get_sharded_message(timeout=1.0)
        if message and message["type"] == "smessage":
            runs.append(parse_run({"msg": message["data"]}))
    pubsub.close()
    assert runs and runs[-1].finished, "no run heard, or no end"
    ids = [t for run in runs for t in run.token_ids]
    first = runs[0].index
    assert ids == expected_tokens(77, 1000, COUNTING_VOCAB)[first : first + len(ids)]


def test_a_batch_goes_through_rq_on_the_plain_redis_beside_the_cluster(stack, tmp_path):
    batch_file, out_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_file.write_text(jsonl(generate_line("a", "one two"), generate_line("b", "three")))
    command = [sys.executable, "-m", "lightq.cli", "batch", "submit", str(batch_file), "--wait"]
    done = subprocess.run(
        [*command, "--url", stack.http, "--output", str(out_file)],
        capture_output=True,
        text=True,
        timeout=MUST_HAPPEN_S,
    )
    assert done.returncode == 0, done.stderr + stack.test_log()[-3000:]
    out = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [line["custom_id"] for line in out] == ["a", "b"]
    assert all(line["response"]["status_code"] == 200 for line in out)


def kill_during(stack, cluster, plane: str) -> tuple[Report, float]:
    """A burst; once tokens flow, SIGKILL the primary of ``plane`` ('control': the ``{q}`` slot's;
    'data': another). Returns the burst's report and how long the failover took."""
    control = cluster.owner(stack.keys.requests())
    victim = control if plane == "control" else next(n for n in cluster.primary_nodes() if n is not control)
    done = Burst(stack.http, requests=120, new_tokens=400, first_token=2000)  # still running at the kill
    took: list[float] = []

    async def fault() -> None:
        # The kill comes once clients hold tokens (what they saw, not a worker record read on a
        # busy machine) and while most of the burst's 48,000 are still to come.
        deadline = time.monotonic() + MUST_HAPPEN_S
        while (got := sum(len(s.events) for s in done.streams)) < 200:
            ended = sum(s.finish_reason is not None or s.error is not None for s in done.streams)
            assert time.monotonic() < deadline, f"the burst did not start: {got} tokens, {ended} streams ended"
            await asyncio.sleep(0.02)
        assert got < done.requests * done.new_tokens // 2, f"the burst was nearly over at the kill: {got} tokens"
        started = time.monotonic()
        await asyncio.to_thread(cluster.kill_primary, victim)
        took.append(time.monotonic() - started)

    async def both() -> None:
        await asyncio.gather(done.run(), fault())

    asyncio.run(both())
    report = done.check()
    if report.lost:  # what the pool holds of them, for the failure's message
        client = stack.client()
        for stream in done.lost()[:5]:
            rid = stream.request_id or "?"
            meta = client.hgetall(stack.keys.meta(rid)) if stream.request_id else {}
            print(f"lost {rid}: {len(stream.events)} tokens, error {stream.error}, status hash {meta}")
        client.close()
    return report, took[0]


@pytest.mark.parametrize("plane", ["control", "data"])
def test_a_primary_killed_mid_burst_loses_and_doubles_nothing(stack, cluster, plane):
    """The replica is promoted; the pool goes on by itself. Requests accepted end exactly once with
    exactly their tokens; while the control plane fails over, new requests get a clear 503 (refused,
    never half-accepted); a burst after it is served whole."""
    report, failover_s = kill_during(stack, cluster, plane)
    print(f"cluster, {plane} primary killed: {report.line()}, failover {failover_s:.1f} s")
    clean(report, refused_ok=plane == "control")
    after = burst(stack, requests=40, first_token=3000).check()
    print(f"cluster, after the {plane} failover: {after.line()}")
    clean(after)


def test_a_frozen_worker_past_its_liveness_writes_nothing_for_requests_that_moved_on(stack):
    """SIGSTOP a busy worker for three liveness periods, then SIGCONT: its requests go on elsewhere
    (the router reaps it and requeues them), and when it wakes every write it makes for them is refused
    (the log says so); clients see each token once."""
    done = Burst(stack.http, requests=40, new_tokens=400, first_token=4000)
    victims: list[int] = []

    async def freeze(running: asyncio.Task) -> None:
        deadline = time.monotonic() + MUST_HAPPEN_S
        while not (busy := sorted(w for w, load in stack.live_workers().items() if load.used_tokens)):
            # (once, on a loaded machine, no worker looked busy for 300 s: say what the burst saw)
            assert not running.done(), f"the burst ended before a worker looked busy: {done.check().line()}"
            assert time.monotonic() < deadline, f"no worker got busy: {stack.live_workers()}"
            await asyncio.sleep(0.05)
        pid = int(busy[0].rsplit("-", 1)[1])
        os.kill(pid, signal.SIGSTOP)
        victims.append(pid)
        await asyncio.sleep(9)  # liveness 3 s
        os.kill(pid, signal.SIGCONT)

    async def both() -> None:
        running = asyncio.ensure_future(done.run())
        await asyncio.gather(running, freeze(running))

    asyncio.run(both())
    report = done.check()
    print("cluster, a worker frozen 9 s:", report.line())
    clean(report)
    deadline = time.monotonic() + MUST_HAPPEN_S
    while "moved on (epoch" not in stack.test_log():
        assert time.monotonic() < deadline, "the thawed worker's writes were not refused"
        time.sleep(0.5)


def test_killing_a_worker_and_the_router_mid_stream_on_the_cluster_loses_and_repeats_nothing(stack):
    """test_chaos.py's test, on the cluster: every one of 200 streams exact, both restarted."""
    chaos.test_killing_a_worker_and_the_router_mid_stream_loses_and_repeats_nothing(stack)


def test_sigterm_drains_a_worker_on_the_cluster_and_hands_the_rest_back(stack):
    """test_chaos.py's SIGTERM drain, on the cluster: every request ends with all its tokens, the drained
    worker hands back what it could not finish (its hand-back writes to inboxes and the ingress on
    other slots than its own records) and exits with 0."""
    chaos.test_sigterm_drains_a_worker_and_hands_the_rest_back(stack)


def final_status(http: str, request_id: str) -> dict:
    """The request's status once it ended; 503s (the cluster still coming back) are waited through."""
    deadline = time.monotonic() + MUST_HAPPEN_S
    while True:
        response = httpx.get(f"{http}/v1/requests/{request_id}", timeout=10)
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200 and response.json()["status"] not in ("queued", "running"):
            return response.json()
        assert time.monotonic() < deadline, f"{request_id} never ended: {response.text}"
        time.sleep(0.3)


def test_the_whole_cluster_restarted_mid_load_leaves_no_request_hanging(stack, cluster):
    """test_chaos.py's Redis restart, on the cluster: every node shut down mid-load (append-only), down
    2 s, started again; every request ends, each with all its tokens."""
    ids = []
    for i in range(60):
        body = {"inputs": [300 + i], "parameters": {"max_new_tokens": chaos.NEW_TOKENS, "ignore_eos": True}}
        ids.append(httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30).json()["id"])
    time.sleep(1.0)
    started = time.monotonic()
    cluster.restart_all()
    final = {request_id: final_status(stack.http, request_id) for request_id in ids}
    print(f"cluster, every node restarted: {len(final)} of {len(ids)} ended in {time.monotonic() - started:.1f} s")
    assert [f["status"] for f in final.values()] == ["finished"] * len(ids), final
    assert all(f["output_tokens"] == chaos.NEW_TOKENS for f in final.values())


def test_killing_the_producer_on_the_cluster_loses_no_request(stack):
    """test_chaos.py's producer SIGKILL, on the cluster: serve starts another, every request queued
    before the kill finishes with all its tokens, and a reader replays one from its first token."""
    chaos.test_killing_the_producer_loses_no_request(stack)
