"""Several hosts on one machine: Linux network namespaces on one switch, for faults between hosts.

``Network(["redis-1", ..., "producer", "router", "worker-1", "worker-2"])`` makes a namespace per
host, each with one interface (``eth0``) and its own address on a private /24 picked free on this
machine, all plugged into a bridge that lives in a namespace of its own (the switch). This process
is plugged in too (the operator's link, the subnet's .254), so a test's own Redis clients and
checks reach every host; the hosts reach one another only through the switch. ``cut(host)`` sets
the host's port on the switch down: a pulled cable, so the host's peers see timeouts, never a
refused connection; ``heal(host)`` sets it up again. ``host.popen(argv)`` runs a process in the
host's namespace (``ip netns exec``), in a session of its own.

Everything is named ``lqh<pid>n<k>-...`` (the operator's link ``lq<pid>n<k>``): ``close`` kills
every process left in the namespaces, deletes them and the link, however the test ended, and a
new ``Network`` first removes what a killed test process (a pid no longer running) left behind.
Needs root and ``ip`` (iproute2); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tests.cluster import LocalCluster, Place
from tests.waiting import MUST_HAPPEN_S

PREFIX = "lqh"
STALE = re.compile(r"^lqh(\d+)n\d+-")
STALE_LINK = re.compile(r"^lq(\d+)n\d+$")
ETC_NETNS = "/etc/netns"  # per-namespace /etc files (ip-netns(8))
_networks = itertools.count()


def pool(workers: int = 2, redis_nodes: int = 6) -> list[str]:
    """The hosts of a pool spread out: Redis nodes, a producer, a router and the workers."""
    redis = [f"redis-{i + 1}" for i in range(redis_nodes)]
    return [*redis, "producer", "router", *(f"worker-{i + 1}" for i in range(workers))]


def ip(*args: str, netns: str = "", check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here (no ``ip``, not root), or None."""
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        done = ip("netns", "add", probe, check=False)
    except FileNotFoundError:
        return "no `ip` command (iproute2) to make network namespaces"
    if done.returncode != 0:
        return f"`ip netns add` failed (root is needed): {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


@dataclass(eq=False)
class Host:
    name: str
    netns: str
    address: str
    port: str  # its interface on the switch
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def wrap(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.netns)

    @property
    def place(self) -> Place:
        """Where a Redis node on this host binds and how it is started (tests.cluster)."""
        return Place(self.address, self.wrap)

    def popen(self, argv: Sequence[str], **options) -> subprocess.Popen:
        """A process on this host (in a session of its own, for signals); ``close`` ends it."""
        process = subprocess.Popen([*self.wrap, *argv], start_new_session=True, **options)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], **options) -> subprocess.CompletedProcess:
        return subprocess.run([*self.wrap, *argv], **options)


class Network:
    def __init__(self, names: Sequence[str], numbers: Mapping[str, int] | None = None):
        """``numbers``: a host's last address byte where it matters (a compose file's fixed
        addresses); the others count from 1 in the order named."""
        self.numbers = {name: (numbers or {}).get(name, i + 1) for i, name in enumerate(names)}
        taken = list(self.numbers.values())
        assert len(set(names)) == len(names) and len(set(taken)) == len(taken), self.numbers
        assert all(0 < n < 254 for n in taken), "254 is the operator's, 0 and 255 are not hosts"
        self.names = list(names)
        self.tag = f"{os.getpid()}n{next(_networks)}"
        self.switch = f"{PREFIX}{self.tag}-switch"
        self.operator_link = f"lq{self.tag}"
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def operator_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet[254])

    def start(self) -> Network:
        sweep_stale()
        try:
            self.subnet = _free_subnet()
            ip("netns", "add", self.switch)
            ip("link", "add", "br0", "type", "bridge", netns=self.switch)
            ip("link", "set", "br0", "up", netns=self.switch)
            self._plug_operator()
            for i, name in enumerate(self.names):
                self._plug_host(i, name)
            for host in self.hosts.values():
                self._write_hosts_file(host)
        except BaseException:
            self.close()
            raise
        return self

    def _plug_operator(self) -> None:
        ip("link", "add", self.operator_link, "type", "veth", "peer", "name", "op", "netns", self.switch)
        ip("link", "set", "op", "master", "br0", "up", netns=self.switch)
        ip("addr", "add", f"{self.operator_address}/24", "dev", self.operator_link)
        ip("link", "set", self.operator_link, "up")

    def _plug_host(self, i: int, name: str) -> None:
        assert self.subnet is not None
        netns, port = f"{PREFIX}{self.tag}-{name}", f"h{i}"
        ip("netns", "add", netns)
        self.hosts[name] = host = Host(name, netns, str(self.subnet[self.numbers[name]]), port)
        ip("link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port, "netns", self.switch)
        ip("link", "set", port, "master", "br0", "up", netns=self.switch)
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=netns)
        ip("link", "set", "eth0", "up", netns=netns)
        ip("link", "set", "lo", "up", netns=netns)  # services that bind 127.0.0.1 (metrics) work too

    def _write_hosts_file(self, host: Host) -> None:
        """Every host by name, as each host resolves it: ``ip netns exec`` mounts the files of
        /etc/netns/NAME/ over /etc/, so ``redis-1:7001`` works in a URL as it would in compose."""
        folder = os.path.join(ETC_NETNS, host.netns)
        os.makedirs(folder, exist_ok=True)
        lines = ["127.0.0.1 localhost", f"{self.operator_address} operator"]
        lines += [f"{h.address} {h.name}" for h in self.hosts.values()]
        with open(os.path.join(folder, "hosts"), "w") as hosts:
            hosts.write("\n".join(lines) + "\n")

    def cut(self, host: Host) -> None:
        """The host's cable pulled at the switch: nobody reaches it, it reaches nobody."""
        ip("link", "set", host.port, "down", netns=self.switch)

    def heal(self, host: Host) -> None:
        ip("link", "set", host.port, "up", netns=self.switch)

    def close(self) -> None:
        """Every process in this network's namespaces killed, the namespaces and the link deleted."""
        for host in self.hosts.values():
            for process in host.processes:
                _kill_group(process)
        for netns in [*(h.netns for h in self.hosts.values()), self.switch]:
            _remove_namespace(netns)
        if ip("link", "show", self.operator_link, check=False).returncode == 0:
            ip("link", "del", self.operator_link, check=False)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_on(hosts: Sequence[Host], **options) -> LocalCluster:
    """A Redis Cluster (not started) with one node on each of ``hosts``: primaries first."""
    return LocalCluster(places=[h.place for h in hosts], **options)


def our_namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]


def sweep_stale() -> None:
    """Namespaces and links left by a test process that no longer runs (killed before its close)."""
    etc = os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []
    for netns in sorted(set(our_namespaces()) | {name for name in etc if name.startswith(PREFIX)}):
        found = STALE.match(netns)
        if found and not _running(int(found.group(1))):
            _remove_namespace(netns)
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().partition("@")[0]
        found = STALE_LINK.match(name)
        if found and not _running(int(found.group(1))):
            ip("link", "del", name, check=False)


def _remove_namespace(netns: str) -> None:
    """Kill whatever still runs in ``netns`` (ours: we made it), then delete it. Deleting only the
    name would leave its processes running, and its links up, in a namespace nobody can name."""
    pids = ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + MUST_HAPPEN_S
    while any(_running(int(pid)) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    ip("netns", "del", netns, check=False)
    shutil.rmtree(os.path.join(ETC_NETNS, netns), ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _running(pid: int) -> bool:
    """A live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.213.0.0/16 that no route of this machine overlaps (another test's network, the
    machine's own): picked at random, so two sessions at once rarely try the same."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    taken = []
    for line in routes.splitlines():
        word = line.split()[0] if line.split() else ""
        if word[0:1].isdigit():
            taken.append(ipaddress.ip_network(word if "/" in word else f"{word}/32", strict=False))
    for third in random.sample(range(256), 256):
        subnet = ipaddress.ip_network(f"10.213.{third}.0/24")
        if not any(subnet.overlaps(t) for t in taken):
            return subnet
    raise RuntimeError("no free /24 in 10.213.0.0/16")
