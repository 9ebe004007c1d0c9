"""Grammar compiles in processes of their own: a slow one can neither starve the model loop nor hold
up a cheap one, and one that nobody waits for any more is stopped.

A compile (xgrammar's token-mask cache of a grammar over the whole vocabulary) takes milliseconds
when typical, and seconds to minutes when a schema asks for it (hundreds of counted patterns, deep
nesting); xgrammar cannot cancel one. So each runs in a child process, one compile per child at a
time, at a lower CPU priority than the model loop and the publishers (``NICE``), and sends its
compiled grammar back serialised (``CompiledGrammar.serialize_json``: kBs, MBs for a large schema;
a few ms each way). Children fork from a fork server that imported xgrammar once, so starting one
costs about 10 ms, not the 2 s of an import: a child is killed and started again freely.

Two lanes. A compile is *slow* once it has run ``slow_after_s``; at most ``processes - 1`` children
run slow compiles. A compile that turns slow past that is stopped (its child killed and started
again) and waits at the front of the slow queue, which gets a child only when the rule allows. So
one child is always free for a new compile, or runs one younger than ``slow_after_s``: a cheap
compile never waits behind a slow one, only (briefly) behind other new ones. A slow compile that
is stopped starts again from the beginning, losing at most ``slow_after_s`` of work.

``cancel`` stops a compile nobody waits for any more (its requests timed out, were cancelled or
handed back): queued, it is dropped; running, its child is killed. A child that dies (a crash in
native code) fails its compile, and another is started.

Threads: ``submit``, ``cancel`` and ``close`` may be called from any thread: each is a message to
the dispatcher thread, which alone owns the queues, the children and their pipes, and resolves the
futures (the caller never waits for a process to be killed or started).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import re
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import xgrammar as xgr

from shared.schemas import Constraint

log = logging.getLogger("lightq.worker")

NICE = 10  # added to a child's niceness: on a busy CPU a compile gets about a tenth of what a step gets
PROCESSES = 2  # children per worker: one for slow compiles, one always left for new ones
SLOW_AFTER_S = 1.0  # a compile that ran this long is slow (typical ones take ms, tens of ms at NICE on a busy CPU)

XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[01:02:03] /x/y.cc:12: " before the reason

CompileFn = Callable[[xgr.GrammarCompiler, Constraint], xgr.CompiledGrammar]


@dataclass(frozen=True)
class Compiled:
    grammar: xgr.CompiledGrammar
    seconds: float  # the compile's own time in its child, for the worker's histogram


class CompileError(RuntimeError):
    """The constraint cannot be compiled: xgrammar's reason, or how its child died."""


class PoolStopped(CompileError):
    """The pool is closed or its dispatcher failed: no fault of the constraint's."""


@dataclass(eq=False)
class _Job:
    constraint: Constraint
    future: futures.Future[Compiled]
    slow: bool = False  # ran past slow_after_s once: it starts again only in the slow lane
    cancelled: bool = False


@dataclass(eq=False)
class _Child:
    process: Any  # multiprocessing.Process
    conn: Connection
    job: _Job | None = None
    since: float = 0.0  # when its job started (time.monotonic)


class CompilePool:
    """``processes`` compile processes of one tokenizer and their two lanes (see the module's doc)."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        compile_fn: CompileFn,
        processes: int = PROCESSES,
        slow_after_s: float = SLOW_AFTER_S,
    ) -> None:
        assert processes >= 2, "one child is kept from slow compiles"
        self._info = info
        self._info_json = info.serialize_json()  # each child's copy (1.6 MB for a 49K vocabulary)
        self._compile_fn = compile_fn
        self._processes, self._slow_after_s = processes, slow_after_s
        self._context = multiprocessing.get_context("forkserver")  # never fork a process that may hold CUDA
        self._context.set_forkserver_preload(["worker.runner.compile_pool"])
        # Callers' requests to the dispatcher, which alone owns everything below them; once it has
        # stopped (closed, or failed) ``_stopped`` is set and a submit fails at once.
        self._asks: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._stopping = threading.Lock()
        self._stopped = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a caller (the model loop) never waits to wake it
        self._fresh: deque[_Job] = deque()  # new compiles, first come first served
        self._slow: deque[_Job] = deque()  # stopped slow ones, waiting for the slow lane
        self._jobs: dict[futures.Future[Compiled], _Job] = {}
        self._children: list[_Child] = []
        self.started: Counter[Constraint] = Counter()  # compiles started per constraint (a restart counts)
        threading.Thread(target=self._run, name="grammar-compile-pool", daemon=True).start()

    def submit(self, constraint: Constraint) -> futures.Future[Compiled]:
        """A future of ``constraint``'s ``Compiled`` grammar (or its ``CompileError``)."""
        future: futures.Future[Compiled] = futures.Future()
        self._ask("submit", _Job(constraint, future))
        return future

    def cancel(self, future: futures.Future[Compiled]) -> None:
        """Stop the compile behind ``future``: dropped if it waits, its child killed if it runs."""
        self._ask("cancel", future)

    def close(self) -> None:
        """Kill the children; compiles not finished fail."""
        self._ask("close", None)

    def _ask(self, what: str, arg: Any) -> None:
        with self._stopping:  # so the pipe is never written once _shut may have closed it
            if self._stopped:
                if what == "submit":
                    arg.future.set_exception(PoolStopped("the grammar compile processes have stopped"))
                return
            self._asks.put((what, arg))
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:  # the pipe is full of wakes the dispatcher has yet to read: one is enough
                pass

    # ---- the dispatcher thread ----

    def _run(self) -> None:
        try:
            self._children = [self._start_child() for _ in range(self._processes)]
            while self._turn():
                pass
        except Exception:  # never silently: a dead dispatcher would hold every constrained request
            log.exception("the grammar compile pool stopped")
            raise
        finally:
            self._shut()

    def _turn(self) -> bool:
        """Take the callers' asks, lane and start compiles, then wait for an answer, a death, an ask
        or the next compile to turn slow; False once closed."""
        if not self._take_asks():
            return False
        now = time.monotonic()
        self._keep_a_lane(now)
        self._assign(now)
        young = [c.since + self._slow_after_s - now for c in self._children if c.job and not c.job.slow]
        waiting = [self._wake_r, *(c.conn for c in self._children), *(c.process.sentinel for c in self._children)]
        ready = wait(waiting, timeout=max(0.0, min(young)) if young else None)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        for child in self._children:
            if child.conn in ready or child.process.sentinel in ready:
                self._answer(child)
        return True

    def _take_asks(self) -> bool:
        while True:
            try:
                what, arg = self._asks.get_nowait()
            except queue.Empty:
                return True
            if what == "close":
                return False
            if what == "submit":
                self._fresh.append(arg)
                self._jobs[arg.future] = arg
            elif (job := self._jobs.pop(arg, None)) is not None:  # cancel
                self._drop(job)

    def _drop(self, job: _Job) -> None:
        job.future.cancel()  # False once running: its result is dropped all the same
        for waiting in (self._fresh, self._slow):
            if job in waiting:
                waiting.remove(job)
        for child in self._children:
            if child.job is job:
                self._restart(child)

    def _keep_a_lane(self, now: float) -> None:
        """Mark compiles past ``slow_after_s`` slow; stop the youngest slow ones past ``processes - 1``."""
        slow = []
        for child in self._children:
            if child.job is not None and (child.job.slow or now - child.since >= self._slow_after_s):
                child.job.slow = True
                slow.append(child)
        for child in sorted(slow, key=lambda c: c.since)[self._processes - 1 :]:
            job = child.job
            assert job is not None
            log.info("a %s grammar compile past %.1f s waits for the slow lane", job.constraint.kind, now - child.since)
            self._restart(child)
            self._slow.appendleft(job)

    def _assign(self, now: float) -> None:
        num_slow = sum(1 for c in self._children if c.job is not None and c.job.slow)
        for child in self._children:
            if child.job is not None:
                continue
            if self._fresh:
                job = self._fresh.popleft()
                job.future.set_running_or_notify_cancel()  # only _drop cancels, and it unqueues first
            elif self._slow and num_slow < self._processes - 1:
                job, num_slow = self._slow.popleft(), num_slow + 1
            else:
                return
            child.job, child.since = job, now
            self.started[job.constraint] += 1
            try:
                child.conn.send(job.constraint)
            except OSError:  # it died: its death is read next, and the compile fails with it
                pass

    def _answer(self, child: _Child) -> None:
        """What ``child`` sent (a compile's result), or its death."""
        job, reply = child.job, None
        try:
            if child.conn.poll():
                reply = child.conn.recv()
        except (EOFError, OSError):
            pass
        if reply is None and child.process.is_alive():
            return  # woken by a death not yet complete: read again next turn
        child.job, exitcode = None, child.process.exitcode
        if reply is None:
            self._replace(child)
        if job is None or self._jobs.pop(job.future, None) is None:
            return  # cancelled: nobody waits for it
        if reply is None:
            job.future.set_exception(CompileError(f"its compile ended the compiling process ({exitcode})"))
        elif reply[0] == "ok":
            try:
                grammar = xgr.CompiledGrammar.deserialize_json(reply[1], self._info)
            except (RuntimeError, ValueError) as exc:  # never expected: the same xgrammar wrote it
                job.future.set_exception(CompileError(f"its compiled grammar could not be read back ({exc})"))
                return
            job.future.set_result(Compiled(grammar, reply[2]))
        else:
            job.future.set_exception(CompileError(reply[1]))

    def _restart(self, child: _Child) -> None:
        child.job = None
        child.process.kill()
        self._replace(child)

    def _replace(self, child: _Child) -> None:
        child.process.join()
        child.conn.close()
        fresh = self._start_child()
        child.process, child.conn = fresh.process, fresh.conn

    def _start_child(self) -> _Child:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=child_main, args=(theirs, self._info_json, self._compile_fn), name="lightq-grammar", daemon=True
        )
        process.start()
        theirs.close()
        return _Child(process, ours)

    def _shut(self) -> None:
        with self._stopping:
            self._stopped = True
        for child in self._children:
            child.process.kill()
            child.process.join()
            child.conn.close()
        while not self._asks.empty():
            what, arg = self._asks.get()
            if what == "submit":
                self._jobs[arg.future] = arg
        for job in self._jobs.values():
            if not job.future.cancel():
                job.future.set_exception(PoolStopped("the grammar compile processes have stopped"))
        self._jobs.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)  # no ask writes after _stopped


def child_main(conn: Connection, info_json: str, compile_fn: CompileFn) -> None:
    """A compile process: constraints in, ``("ok", serialised grammar, seconds)`` or ``("error",
    reason)`` out, until the worker closes its end (or is gone). Ctrl-C reaches the whole process
    group: a child ignores it (its worker stops it), or it died with a traceback and the pool
    started another while the worker exited (an EOFError traceback at every Ctrl-C)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(NICE)
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # one core per compile
    while True:
        try:
            constraint = conn.recv()
        except (EOFError, OSError):
            return
        started = time.perf_counter()
        try:
            grammar = compile_fn(compiler, constraint)
            reply: tuple[Any, ...] = ("ok", grammar.serialize_json(), time.perf_counter() - started)
        except (RuntimeError, ValueError) as exc:  # xgrammar reports bad input as RuntimeError
            lines = str(exc).strip().splitlines()
            reply = ("error", XGRAMMAR_PREFIX.sub("", lines[-1]) if lines else type(exc).__name__)
        try:
            conn.send(reply)
        except OSError:
            return
