"""Tensor parallelism across processes: ``lightq worker --tp N`` is one worker of N ranks.

Rank 0 is the worker everyone else sees: it reads the inbox, runs the engine
and the scheduler, samples, publishes and heartbeats (one load record for the
group). Ranks 1..N-1 are followers, child processes that hold their slice of
the weights and their share of the KV heads and do nothing but forwards::

    rank 0:   engine.step() -> runner.forward(step) -> send_step(step) -> model
    rank r:   recv_step() ---------------------------> runner.forward(step) -> model
                                                         (all-reduces join the two)

A step travels as one broadcast of a fixed int64 header ``[kind, B, T, F]``
and, for a forward, one of its payload: input ids, positions, slots [T each],
table rows, cached lengths, new lengths [B each], and a group fork's row
copies [F x 3]. Each rank writes its own
request table from them and runs the same forward (a CUDA graph for the same
bucket on every rank), so the ranks stay in lock-step. Steps go over a gloo
group on the host (no device copies, no stream ordering to think about);
the model's all-reduces use the default group: NCCL on CUDA, gloo on CPU.

Lifetime: followers ignore SIGINT/SIGTERM; they leave on the shutdown
message, or when rank 0's process is gone (a watchdog thread). Rank 0 exits
at once when a follower dies unexpectedly: a group missing a rank can only
hang, and the router re-dispatches a dead worker's requests.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from worker.model.layers import TensorParallel
from worker.runner.step_inputs import StepInputs

log = logging.getLogger("lightq.worker")

HOST = "127.0.0.1"
SHUTDOWN, FORWARD_PREFILL, FORWARD_DECODE = 0, 1, 2
JOIN_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.5


@dataclass
class TPGroup:
    """This process's place in the group; on rank 0 also its followers."""

    tp: TensorParallel  # what the model layers split and all-reduce with
    control: object  # gloo ProcessGroup the steps are broadcast over
    followers: list = field(default_factory=list)  # rank 0: multiprocessing.Process per follower
    closing: bool = False

    @property
    def rank(self) -> int:
        return self.tp.rank

    @property
    def size(self) -> int:
        return self.tp.size

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (each rank's KV pool gets the same size)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_step(self, step: StepInputs) -> None:
        """Rank 0, before each of its forwards: the followers run the same one."""
        assert not step.ids_on_device, "followers take their input ids from rank 0: a --tp worker never overlaps"
        kind = FORWARD_DECODE if step.is_decode else FORWARD_PREFILL
        counts = [kind, len(step.rows), len(step.input_ids), len(step.forks), len(step.prefix)]
        self._broadcast(np.array(counts, dtype=np.int64))
        self._broadcast(
            np.concatenate(
                [
                    step.input_ids,
                    step.positions,
                    step.slots,
                    step.rows,
                    step.cached,
                    step.q_lens,
                    step.forks.reshape(-1),
                    step.prefix.reshape(-1),
                ]
            ).astype(np.int64, copy=False)
        )

    def recv_step(self) -> StepInputs | None:
        """A follower: the next step, None on shutdown."""
        kind, b, t, f, p = self._receive(5)
        if kind == SHUTDOWN:
            return None
        payload = self._receive(3 * t + 3 * b + 3 * f + 3 * p)
        ids, positions, slots, rows, cached, q_lens, forks, prefix = np.split(
            payload, np.cumsum([t, t, t, b, b, b, 3 * f])
        )
        decode = kind == FORWARD_DECODE
        return StepInputs(
            ids, positions, slots, rows, cached, q_lens, decode, forks.reshape(-1, 3), prefix.reshape(-1, 3)
        )

    def _broadcast(self, values: np.ndarray) -> None:
        dist.broadcast(torch.from_numpy(np.ascontiguousarray(values)), src=0, group=self.control)

    def _receive(self, n: int) -> np.ndarray:
        buffer = torch.empty(n, dtype=torch.int64)
        dist.broadcast(buffer, src=0, group=self.control)
        return buffer.numpy()

    def close(self) -> None:
        """Rank 0, on a clean exit: tell the followers to leave and reap them.

        The process group is not destroyed, on any rank: with NCCL on two H200s,
        ``destroy_process_group`` hung on both sides (rank 0 and its follower each in
        their teardown, with the decode graphs that captured the all-reduces still alive),
        run one after the other or at the same time. A process leaves right after this
        instead (``exit_now``), and the driver frees what it held. A gloo group (CPU) is
        torn down locally and cleanly, so rank 0 can start another group (tests do)."""
        self.closing = True
        try:
            self._broadcast(np.array([SHUTDOWN, 0, 0, 0, 0], dtype=np.int64))
        finally:
            self._reap(JOIN_TIMEOUT_S)
            if dist.get_backend() == "gloo":
                dist.destroy_process_group()

    def abort(self) -> None:
        """Rank 0, on an error: followers may be stuck in a collective, so they are killed
        (and the process group is left as it is: the process is on its way out)."""
        self.closing = True
        self._reap(0.0)

    def _reap(self, timeout_s: float) -> None:
        for proc in self.followers:
            proc.join(timeout_s)
            if proc.is_alive():
                log.warning("tensor-parallel rank (pid %d) did not exit: killing it", proc.pid)
                proc.kill()
                proc.join()


def init_rank(rank: int, size: int, port: int, device: torch.device) -> TPGroup:
    """A follower joins the group whose store rank 0 hosts on ``port``."""
    store = dist.TCPStore(HOST, port, size, is_master=False)
    group = TPGroup(TensorParallel(rank, size), None)
    _join(group, store, device)
    return group


def launch(size: int, device: torch.device, target, *args) -> TPGroup:
    """Rank 0: start ranks 1..size-1 as ``target(rank, size, port, *args)`` and join the group with them.

    ``target`` must be importable (the followers are spawned); it ends in ``follow``.
    """
    store = dist.TCPStore(HOST, 0, size, is_master=True, wait_for_workers=False)  # a free port, no race
    context = multiprocessing.get_context("spawn")
    group = TPGroup(
        TensorParallel(0, size),
        None,
        [
            context.Process(target=target, args=(rank, size, store.port, *args), name=f"lightq-tp{rank}")
            for rank in range(1, size)
        ],
    )
    for proc in group.followers:
        proc.start()
    threading.Thread(target=_watch_followers, args=(group,), name="lightq-tp-watch", daemon=True).start()
    try:
        _join(group, store, device)
    except BaseException:
        group.abort()
        raise
    log.info(
        "tensor parallel: %d ranks over %s, followers pid %s",
        size,
        dist.get_backend(),
        [p.pid for p in group.followers],
    )
    return group


def _join(group: TPGroup, store, device: torch.device) -> None:
    """init_process_group (NCCL on CUDA, gloo on CPU) plus the gloo group steps travel on."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", store=store, rank=group.rank, world_size=group.size)
    group.control = dist.new_group(backend="gloo") if on_cuda else dist.group.WORLD
    # One collective now, on the model's group: NCCL sets up its communicator here, never inside a capture.
    dist.all_reduce(torch.zeros(1, device=device))


def follow(group: TPGroup, runner) -> None:
    """A follower's life after loading: run each step rank 0 sends, until it says stop."""
    while (step := group.recv_step()) is not None:
        runner.forward(step)
        if runner.device.type == "cuda":
            # Done with this step's host inputs (the graph's pinned buffer) before the next overwrites them.
            torch.cuda.current_stream().synchronize()
    # No destroy_process_group: see TPGroup.close. The caller leaves through exit_now.


def exit_now(code: int = 0) -> None:
    """Leave without the interpreter's teardown, where the collective library's destructors and
    threads can hang or abort the process ("terminate called without an active exception",
    exit -6, seen in CI); logs and output are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_follower() -> None:
    """First thing in a follower: signals are rank 0's to handle; leave when it is gone."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="lightq-tp-parent", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        threading.Event().wait(WATCH_INTERVAL_S)
        if os.getppid() != parent:
            log.error("tensor-parallel rank 0 (pid %d) is gone: exiting", parent)
            os._exit(1)


def _watch_followers(group: TPGroup) -> None:
    sentinels = {proc.sentinel: proc for proc in group.followers}
    ready = multiprocessing.connection.wait(list(sentinels))
    if group.closing:
        return
    proc = sentinels[ready[0]]
    log.error(
        "tensor-parallel follower %s (pid %d) exited with %s: the group cannot go on, exiting",
        proc.name,
        proc.pid,
        proc.exitcode,
    )
    os._exit(1)
