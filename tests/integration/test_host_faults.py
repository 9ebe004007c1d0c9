"""A pool spread over hosts (network namespaces on one machine, tests/hosts.py): a Redis Cluster of 3
primaries and 3 replicas on six hosts, a producer, two routers and two workers on hosts of their own,
each service a process of its own (``lightq producer|router|worker``, the counting model). Faults cut a
host's link (a pulled cable: silence, not refusals) past the pool's liveness, then heal it; every burst
is judged token by token (tests/checker.py) and each report line printed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from router.workers.registry import read_registry
from shared.config import RedisSettings
from shared.keys import Keys
from shared.redis import sync_client
from tests.checker import Burst, Report
from tests.hosts import Host, Network, cluster_on, unavailable
from tests.waiting import MUST_HAPPEN_S

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
REPO = Path(__file__).resolve().parents[2]
PREFIX = "lqhosts"
PORT = 8000
CUT_S = 8.0  # past every liveness: a worker's record (1.5 s), a router's (3 s)


@dataclass
class Pool:
    net: Network
    url: str
    logs: Path

    @property
    def http(self) -> str:
        return f"http://{self.net['producer'].address}:{PORT}"

    def client(self):
        return sync_client(RedisSettings(url=self.url, key_prefix=PREFIX))

    def live(self) -> dict:
        client = self.client()
        try:
            return read_registry(client, Keys(PREFIX)).live
        finally:
            client.close()

    def log(self, host: str) -> str:
        return (self.logs / f"{host}.log").read_text()


def start(host: Host, logs: Path, service: str, url: str, *flags: str) -> None:
    argv = [sys.executable, "-m", "lightq.cli", service, "--redis_url", url, "--redis_key_prefix", PREFIX, *flags]
    out = open(logs / f"{host.name}.log", "w")
    host.popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def until(check, what: str) -> None:
    deadline = time.monotonic() + MUST_HAPPEN_S
    while not _safely(check):
        assert time.monotonic() < deadline, f"not within the hang guard: {what}"
        time.sleep(0.3)


def _safely(check) -> bool:
    try:
        return bool(check())
    except Exception:
        return False


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from tests.cluster import redis_binaries

    try:
        redis_binaries()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    logs = tmp_path_factory.mktemp("hosts")
    redis_hosts = [f"redis-{i}" for i in range(1, 7)]
    with Network([*redis_hosts, "producer", "router", "router-2", "worker-1", "worker-2"]) as net:
        with cluster_on([net[name] for name in redis_hosts], node_timeout_ms=2000) as cluster:
            url = cluster.url
            counting = ["--model_dir", "counting", "--max_req_total_len", "1100"]
            for name in ("worker-1", "worker-2"):
                start(net[name], logs, "worker", url, *counting, "--max_total_token_num", "60000")
            for name in ("router", "router-2"):
                start(net[name], logs, "router", url)
            start(net["producer"], logs, "producer", url, *counting, "--host", "0.0.0.0", "--port", str(PORT))
            found = Pool(net, url, logs)
            until(lambda: httpx.get(f"{found.http}/health", timeout=2).status_code == 200, "the producer answers")
            until(lambda: len(found.live()) == 2, "two live workers")
            yield found


def clean(report: Report) -> None:
    assert report.lost == 0 and report.duplicated == 0 and report.wrong == 0 and report.refused == 0, report.line()
    assert report.ended == report.sent, report.line()


def burst_with(pool: Pool, fault, requests: int = 40, new_tokens: int = 300, first: int = 5000) -> Report:
    done = Burst(pool.http, requests=requests, new_tokens=new_tokens, first_token=first)

    async def both() -> None:
        await asyncio.gather(done.run(), asyncio.to_thread(fault))

    asyncio.run(both())
    return done.check()


def busy_worker(pool: Pool) -> str:
    """The host of a worker that runs something (worker ids are host-pid: the host is found by pid)."""
    until(lambda: any(load.used_tokens for load in pool.live().values()), "a worker gets busy")
    worker_id = sorted(w for w, load in pool.live().items() if load.used_tokens)[0]
    pid = worker_id.rsplit("-", 1)[1]
    return next(h for h in ("worker-1", "worker-2") if any(str(p.pid) == pid for p in pool.net[h].processes))


def test_a_worker_host_cut_off_past_its_liveness_loses_nothing_and_writes_nothing_stale(pool):
    """Its requests go on on the other worker; healed, it writes nothing for a request that moved on
    (its log says each refusal), and it serves again."""
    cut: list[str] = []

    def fault() -> None:
        name = busy_worker(pool)
        cut.append(name)
        pool.net.cut(pool.net[name])
        time.sleep(CUT_S)
        pool.net.heal(pool.net[name])

    started = time.monotonic()
    report = burst_with(pool, fault)
    print(f"hosts, {cut[0]} cut {CUT_S:.0f} s: {report.line()}, burst {time.monotonic() - started:.1f} s")
    clean(report)
    until(lambda: "moved on (epoch" in pool.log(cut[0]), f"{cut[0]}'s stale writes refused")
    until(lambda: len(pool.live()) == 2, "the healed worker serves again")
    after = burst_with(pool, lambda: None, requests=20, new_tokens=40, first=6000)
    print(f"hosts, after the heal: {after.line()}")
    clean(after)


def test_a_router_host_cut_off_while_another_runs_leaks_nothing(pool):
    """Dispatch goes on through the other router; once all has ended, nothing is still reserved: every
    worker's record commits no tokens and no ingress entry is left pending."""

    def fault() -> None:
        time.sleep(0.5)
        pool.net.cut(pool.net["router"])
        time.sleep(CUT_S)
        pool.net.heal(pool.net["router"])

    report = burst_with(pool, fault, first=7000)
    print(f"hosts, a router cut {CUT_S:.0f} s: {report.line()}")
    clean(report)
    client = pool.client()
    try:
        until(lambda: all(load.committed_tokens == 0 for load in pool.live().values()), "no tokens committed")
        stream = Keys(PREFIX).requests()
        until(lambda: client.xpending(stream, "routers")["pending"] == 0, "no ingress entry pending")
    finally:
        client.close()


PROBE = """
import json, sys, time, httpx
started = time.monotonic()
try:
    status = httpx.post(sys.argv[1] + "/generate", json={"inputs": [1, 2], "parameters": {"max_new_tokens": 4}},
                        timeout=60).status_code
except httpx.HTTPError as exc:
    status = type(exc).__name__
print(json.dumps({"status": status, "seconds": time.monotonic() - started}))
"""


def test_a_producer_host_cut_off_answers_503_quickly_and_loses_nothing(pool):
    """Clients on the producer's own host (they reach it over its loopback; the cut takes only its link):
    a request sent while it is cut off from Redis gets a 503 within seconds, not a hang; the streams it
    was serving when the cut came finish after the heal, every token once."""
    producer = pool.net["producer"]
    local = f"http://127.0.0.1:{PORT}"
    checker = [sys.executable, "-m", "tests.checker", local, "--requests", "20", "--new-tokens", "300"]
    running = producer.popen([*checker, "--first", "8000"], cwd=REPO, stdout=subprocess.PIPE, text=True)
    until(lambda: any(load.used_tokens for load in pool.live().values()), "the burst runs")
    pool.net.cut(producer)
    try:
        time.sleep(1.0)
        probe = producer.run([sys.executable, "-c", PROBE, local], cwd=REPO, capture_output=True, text=True)
        answer = json.loads(probe.stdout)
    finally:
        time.sleep(2.0)
        pool.net.heal(producer)
    out, _ = running.communicate(timeout=MUST_HAPPEN_S)
    report = Report(**json.loads(out.strip().splitlines()[-1]))
    print(
        f"hosts, the producer cut: a new request got {answer['status']} in {answer['seconds']:.1f} s; {report.line()}"
    )
    assert answer["status"] == 503 and answer["seconds"] < MUST_HAPPEN_S
    clean(report)
