"""A compile function for the worker's compile processes that holds chosen constraints at a gate, so
a slow compile is slow for exactly as long as a test says. The processes are not the test's, so the
gate is a folder: a held compile writes ``started-<pid>`` and waits until ``release`` exists; then it
compiles for real (``compile_constraint``). ``CRASH``'s compile ends its process."""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

from shared.schemas import Constraint
from worker.runner.grammar_cache import compile_constraint

CRASH = Constraint(kind="regex", spec="crash")  # its compile ends its process, as a crash in native code would


def gated_compile(folder: str, gated: frozenset[Constraint], compiler, constraint: Constraint):
    if constraint == CRASH:
        os._exit(3)
    if constraint in gated:
        Path(folder, f"started-{os.getpid()}").touch()
        while not Path(folder, "release").exists():
            time.sleep(0.01)
    return compile_constraint(compiler, constraint)


class Gate:
    """The test's side: the compile function to give the cache, and the gate's events."""

    def __init__(self, folder: Path, *gated: Constraint):
        self.folder = folder
        self.compile_fn = functools.partial(gated_compile, str(folder), frozenset(gated))

    def started(self) -> list[int]:
        """The pids of the processes whose compiles reached the gate."""
        return [int(p.name.split("-")[1]) for p in self.folder.glob("started-*")]

    def wait_started(self, count: int, timeout_s: float = 60.0) -> list[int]:
        """Until ``count`` compiles reached the gate (fails after ``timeout_s``: one never came)."""
        deadline = time.monotonic() + timeout_s
        while len(self.started()) < count:
            assert time.monotonic() < deadline, f"{len(self.started())} of {count} compiles reached the gate"
            time.sleep(0.01)
        return self.started()

    def release(self) -> None:
        (self.folder / "release").touch()


def wait_gone(pid: int, timeout_s: float = 60.0) -> None:
    """Until process ``pid`` has exited (killed by the pool)."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
