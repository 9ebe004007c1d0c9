"""The multi-host harness (tests/hosts.py): hosts in network namespaces reach one another over the
switch only, a cut link makes a client fail within its socket timeout (not hang), a heal brings it
back, a Redis Cluster spread over hosts fails over when a primary's host is cut off, and nothing of
the harness is left afterwards, however the test ended."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.cluster import redis_binaries
from tests.hosts import Network, cluster_on, our_namespaces, pool, unavailable
from tests.waiting import MUST_HAPPEN_S

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

# One connection, kept: each line on stdin is a PING over it; the answer is "ok" or the error's type.
# No retries (redis-py retries 3 times by default), timeouts of half a second: a cut link is an
# error within about that, where the default (no timeout) would wait forever.
PROBE = """
import sys, redis
from redis.backoff import NoBackoff
from redis.retry import Retry
client = redis.Redis(sys.argv[1], int(sys.argv[2]), socket_timeout=0.5, socket_connect_timeout=0.5,
                     retry=Retry(NoBackoff(), 0))
for line in sys.stdin:
    try:
        client.ping()
        print("ok", flush=True)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        print("error", type(exc).__name__, flush=True)
"""


def ask(probe: subprocess.Popen) -> str:
    probe.stdin.write("ping\n")
    probe.stdin.flush()
    return probe.stdout.readline().strip()


def until(check) -> bool:
    """True once ``check`` is (each try is bounded by the probe's own timeouts); False only past the
    hang guard."""
    deadline = time.monotonic() + MUST_HAPPEN_S
    while time.monotonic() < deadline:
        if check():
            return True
    return False


def start_server(host) -> None:
    server = redis_binaries(minimum=(6, 0, 0))[0]
    argv = [server, "--bind", host.address, "--port", "6379", "--save", "", "--protected-mode", "no"]
    host.popen(argv, stdout=subprocess.DEVNULL)


def test_a_cut_link_fails_fast_and_heals():
    with Network(["redis", "client"]) as net:
        server, client = net["redis"], net["client"]
        start_server(server)
        resolved = client.run(["getent", "hosts", "redis"], capture_output=True, text=True).stdout
        assert resolved.split()[:2] == [server.address, "redis"], "each host resolves the others by name"
        probe = client.popen(
            [sys.executable, "-c", PROBE, server.address, "6379"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert until(lambda: ask(probe) == "ok"), "the client host never reached the server host"
        no_retry = Retry(NoBackoff(), 0)
        operator = redis.Redis(server.address, 6379, socket_timeout=0.5, socket_connect_timeout=0.5, retry=no_retry)
        assert operator.ping()

        net.cut(server)
        assert ask(probe) == "error TimeoutError"  # the open connection: no answer, a timeout
        assert ask(probe) in ("error TimeoutError", "error ConnectionError")  # a new one cannot connect
        with pytest.raises((redis.TimeoutError, redis.ConnectionError)):
            operator.ping()  # cut off from every host, the operator's link too

        net.heal(server)
        assert until(lambda: ask(probe) == "ok"), "the client never got through again after the heal"
        operator.close()
        processes = [p for h in net.hosts.values() for p in h.processes]
        names = [h.netns for h in net.hosts.values()] + [net.switch]
    assert all(p.poll() is not None for p in processes)
    assert not set(names) & set(our_namespaces())


def test_close_after_a_failure_removes_everything():
    net = Network(["a", "b"])
    with pytest.raises(RuntimeError, match="the test failed"):
        with net:
            sleeper = net["a"].popen(["sleep", "600"])
            raise RuntimeError("the test failed")
    assert sleeper.poll() is not None
    assert not {h.netns for h in net.hosts.values()} & set(our_namespaces())
    assert not any(os.path.exists(f"/etc/netns/{h.netns}") for h in net.hosts.values())
    assert subprocess.run(["ip", "link", "show", net.operator_link], capture_output=True).returncode != 0


def test_a_cluster_over_hosts_fails_over_when_a_primary_is_cut_off():
    """The layout of a pool spread out (6 Redis hosts, a producer, a router, 2 workers): a worker host
    writes to every primary; a primary's host cut off, its replica takes over and the worker writes
    there again; healed, the old primary rejoins as a replica."""
    try:
        redis_binaries()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with Network(pool(workers=2)) as net:
        redis_hosts = [net[f"redis-{i}"] for i in range(1, 7)]
        with cluster_on(redis_hosts, node_timeout_ms=2000) as cluster:
            keys = [f"lightq:{{r:{i}}}:meta" for i in range(32)]
            assert {cluster.owner(k).name for k in keys} == {n.name for n in cluster.primary_nodes()}
            worker = net["worker-1"]
            assert write_from(worker, cluster.url, keys) == "ok 32"

            lost = cluster.owner(keys[0])
            host = next(h for h in redis_hosts if h.address == lost.place.address)
            net.cut(host)
            promoted = cluster.wait_failover(lost)
            assert cluster.owner(keys[0]) is promoted
            assert write_from(worker, cluster.url, keys) == "ok 32"

            net.heal(host)
            cluster.wait_converged()
            assert lost.role() == "slave" and cluster.replicas_of(promoted) == [lost]


WRITER = """
import sys
from redis.cluster import RedisCluster, ClusterNode
nodes = [ClusterNode(a.rsplit(":", 1)[0], int(a.rsplit(":", 1)[1])) for a in sys.argv[1].removeprefix("redis+cluster://").split(",")]
client = RedisCluster(startup_nodes=nodes, decode_responses=True, socket_timeout=1, socket_connect_timeout=1)
print("ok", sum(client.hset(key, "status", "queued") >= 0 for key in sys.argv[2:]))
"""


def write_from(host, url: str, keys: list[str]) -> str:
    """Each key written by a cluster client on ``host`` (startup nodes: the URL's); what it printed."""
    done = host.run([sys.executable, "-c", WRITER, url, *keys], capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or done.stderr[-2000:]
