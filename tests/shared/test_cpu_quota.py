"""``bench.serving.cpu_quota``: a process held to a share of a core spends no more than that share
(what ``cluster_scale --redis-cpu-percent`` relies on to make Redis the bound). Root and a cgroup cpu
controller only; the bound checked is loose (3x the share, plus a period): a quota is a hard cap."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.serving.cpu_quota import V1, V2, CpuQuota


def _has_controller() -> bool:
    if (V1 / "cpu.cfs_quota_us").exists():
        return os.access(V1, os.W_OK)
    controllers = V2 / "cgroup.controllers"
    return controllers.exists() and "cpu" in controllers.read_text().split() and os.access(V2, os.W_OK)


@pytest.mark.skipif(os.geteuid() != 0 or not _has_controller(), reason="needs root and a cgroup cpu controller")
def test_a_held_process_spends_at_most_its_share_of_a_core():
    try:
        quota = CpuQuota(f"lightq-test-quota-{os.getpid()}", 5)
    except OSError as exc:  # a controller this process may not write (not delegated, read-only)
        pytest.skip(f"no cgroup to hold a process: {exc}")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        quota.hold(spin.pid)
        assert str(spin.pid) in (quota.path / "cgroup.procs").read_text().split()
        before, t0 = _cpu_s(spin.pid), time.monotonic()
        time.sleep(1.0)
        spent, wall = _cpu_s(spin.pid) - before, time.monotonic() - t0
        assert spent <= 3 * 0.05 * wall + 0.1, (spent, wall)  # unheld it would spend ~a whole core
    finally:
        spin.kill()
        spin.wait()
        quota.remove()
    assert not quota.path.exists()


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
