"""The publisher process beside each worker, and the model loop's end of its pipes.

The model loop's host work and the publisher's (detokenising, stop strings,
one Redis write per token) used to share one GIL: every publisher
millisecond was one the model loop waited for. Here the publisher is a
process of its own, fed one pickled message per step through a pipe (the
step's events: a ``Tokens`` record of columns, plus the rare per-request
events), and it answers with the samples a stop string ended through a
second pipe. It drains whatever steps are waiting before it writes, so
when it falls behind it catches up in one Redis pipeline, never by
dropping anything.

Lifetimes are tied both ways: the publisher ends when the worker closes
its pipe or dies (end of file); a publisher that dies makes ``put`` or
``check`` raise ``PublisherDied``, and the worker hands its inbox back and
exits. Its requests then resume on a worker from the last token Redis
holds, as after any worker death: the chunk stream is the record, so no
index is lost or repeated.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import signal
from multiprocessing.connection import Connection

from shared.config import WorkerSettings
from shared.model_files import load_tokenizer, resolve
from shared.redis import sync_client
from shared.request_log import now_ms
from shared.service import setup_logging
from worker.events import Event
from worker.publisher import Publisher, Sample

log = logging.getLogger("lightq.worker")

F_SETPIPE_SZ = 1031  # Linux: a larger pipe lets the model loop run a few steps ahead without blocking
PIPE_BYTES = 1 << 20
MAX_STEPS_PER_WRITE = 64  # steps drained into one Redis pipeline when behind
CLOSE_TIMEOUT_S = 60.0


class PublisherDied(RuntimeError):
    """The publisher process is gone: tokens the model loop made since its last write are lost."""


class PublisherLink:
    """The model loop's side: start the process, send steps, collect stop-string ends."""

    def __init__(self, settings: WorkerSettings, worker_id: str):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        events_in, self._events = ctx.Pipe(duplex=False)
        self._stops, stops_out = ctx.Pipe(duplex=False)
        _grow(self._events)
        self.process = ctx.Process(target=run, args=(settings, worker_id, events_in, stops_out),
                                   name=f"lightq-publisher-{worker_id}", daemon=True)
        self._child_ends = (events_in, stops_out)

    def start(self) -> None:
        self.process.start()
        for end in self._child_ends:  # only the child holds them now: its death reads as end of file here
            end.close()
        log.info("publisher process %d started", self.process.pid)

    def put(self, events: list[Event]) -> None:
        """A step's events, stamped with the step's end (a request's ``stepped_ms``)."""
        if not events:
            return
        try:
            self._events.send((now_ms(), events))
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:
            raise PublisherDied(f"publisher process {self.process.pid} is gone ({exc})") from None

    def take_stopped(self) -> list[Sample]:
        """(request id, choice) of samples a stop string ended since the last call."""
        stopped: list[Sample] = []
        try:
            while self._stops.poll():
                stopped += self._stops.recv()
        except (EOFError, OSError):
            self.check()
        return stopped

    def check(self) -> None:
        if not self.process.is_alive():
            raise PublisherDied(f"publisher process {self.process.pid} exited with {self.process.exitcode}")

    def close(self) -> None:
        """Publish everything sent so far, then stop the process (at once if it is dead)."""
        if self.process.is_alive():
            try:
                self._events.send(None)
            except OSError:
                pass
            self.process.join(CLOSE_TIMEOUT_S)
        if self.process.is_alive():
            log.warning("publisher process %d did not finish in %.0f s: killed", self.process.pid, CLOSE_TIMEOUT_S)
            self.process.kill()
        self._events.close()
        self._stops.close()


def _grow(conn: Connection) -> None:
    try:
        fcntl.fcntl(conn.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # not Linux, or above the system's pipe-max-size: the default pipe still works
        pass


def run(settings: WorkerSettings, worker_id: str, events: Connection, stops: Connection) -> None:
    """The publisher process: write each step's events until the worker closes the pipe."""
    # Ctrl-C reaches the whole process group; the worker decides when to stop, and this
    # process must still write what the worker's drain produces, so it ignores both signals.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging()
    tokenizer = load_tokenizer(resolve(settings.model.model_dir))
    client = sync_client(settings.redis)
    publisher = Publisher(settings, client, tokenizer, worker_id)
    while (steps := _next_steps(events)) is not None:
        last = steps[-1] is None
        stopped = publisher.publish(steps[:-1] if last else steps)
        if stopped and not last:
            stops.send(stopped)
        if last:
            break
    client.close()


def _next_steps(events: Connection) -> list | None:
    """The waiting steps (at least one; blocks for it), or None at the end. A list that ends
    with None is the last one: the worker closed the pipe after those steps."""
    steps: list = []
    try:
        steps.append(events.recv())
        while steps[-1] is not None and len(steps) < MAX_STEPS_PER_WRITE and events.poll():
            steps.append(events.recv())
    except EOFError:  # the worker is gone: write what arrived, then stop
        return [*steps, None] if steps else None
    return steps
