"""A process held to a share of one core, through a Linux cgroup of its own (as root).

``bench.serving.cluster_scale --redis-cpu-percent P`` puts each Redis node into one, so that Redis,
not the pool's own processes, is what binds: on a host whose cores the workers and the producer fill
long before Redis (every host lent here: one Redis core carries ~300,000 tokens/s at ~3 µs a token),
that is the only way to see what more primaries buy a pool whose Redis is the bottleneck. Each node
gets the same share, so P primaries have P times one node's Redis CPU, as P equal hosts would.

cgroup v1's ``cpu`` controller (``cpu.cfs_quota_us`` per ``cpu.cfs_period_us``) where it is mounted,
else cgroup v2's ``cpu.max``. The quota's least is 1 ms a period: the period is 100 ms, so a share
is at least 1%; a node held to it runs its share then waits for the next period (its clients see
latency of up to a period, which the pool rides out).
"""

from __future__ import annotations

import os
from pathlib import Path

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CpuQuota:
    def __init__(self, name: str, percent: float):
        quota = max(1000, int(PERIOD_US * percent / 100))
        if (V1 / "cpu.cfs_quota_us").exists():
            self.path = V1 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        elif "cpu" in (V2 / "cgroup.controllers").read_text().split():
            self.path = V2 / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            raise RuntimeError("no cgroup cpu controller to hold a process to a share of a core")
        self.percent = quota * 100 / PERIOD_US

    def hold(self, pid: int) -> None:
        """``pid`` (and the threads it starts later) into this cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Gone, once its processes are (a cgroup with a live task cannot be removed): any left are
        moved back to the root first."""
        root = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                root.write_text(pid)
            except OSError:  # exited meanwhile
                pass
        os.rmdir(self.path)
