"""The publisher processes beside each worker, and the model loop's end of their pipes.

The model loop's host work and the publisher's (detokenising, stop strings,
one Redis write per token) used to share one GIL: every publisher
millisecond was one the model loop waited for. Here publishing is done by
``--publishers`` processes of their own, each fed every step's events
through a pipe (pickled once, written to each pipe: a ``Tokens`` record of
columns plus the rare per-request events); each process publishes only the
requests of its shard (``owner``: a stable hash of the request id, so a
request's chunks stay in order) and answers with the samples a stop string
ended through a second pipe. A process drains whatever steps are waiting
before it writes, so when it falls behind it catches up in one Redis
pipeline, never by dropping anything. Several shards exist because one
process could not keep up with an H200 at batch 1,000 (about 40 us a token
against a 25 ms step: issue 13).

Lifetimes are tied both ways: a publisher ends when the worker closes its
pipe or dies (end of file); a publisher that dies makes ``put`` or
``check`` raise ``PublisherDied``, and the worker hands its inbox back and
exits. Its requests then resume on a worker from the last token Redis
holds, as after any worker death: the chunk stream is the record, so no
index is lost or repeated. A publisher that lives but writes nothing
(frozen, or hung on a connection that died without a word) would stall its
requests for ever while the worker's heartbeat said all is well: each
process counts the steps it has written in shared memory, and a watchdog
thread kills one that has left steps unwritten for ``--publisher_stall_s``
while Redis answers (an outage is waited out, not punished), which turns
it into the death above.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized

from shared.model_files import load_tokenizer, resolve
from shared.redis import sync_client, wait_until_up
from shared.request_log import now_ms
from shared.service import setup_logging
from shared.worker_settings import WorkerSettings
from worker.engine.events import Event
from worker.service.pending import ORPHAN_RETRY_S
from worker.service.publisher import Publisher

log = logging.getLogger("lightq.worker")

F_SETPIPE_SZ = 1031  # Linux: a larger pipe lets the model loop run a few steps ahead without blocking
PIPE_BYTES = 1 << 20
MAX_STEPS_PER_WRITE = 64  # steps drained into one Redis pipeline when behind
CLOSE_TIMEOUT_S = 60.0
READY = "ready"  # a publisher's first message on its stops pipe


def owner(request_id: str, shards: int) -> int:
    """The publisher shard that writes ``request_id``'s chunks (the same in every process)."""
    return zlib.crc32(request_id.encode()) % shards


class PublisherDied(RuntimeError):
    """A publisher process is gone: tokens the model loop made since its last write are lost."""


WATCH_PERIOD_S = 1.0


@dataclass
class _Shard:
    process: multiprocessing.process.BaseProcess
    events: Connection  # the model loop writes steps here
    stops: Connection  # and reads stop-string ends here
    written: Synchronized  # steps the process has written to Redis (it counts; shared memory)
    sent: int = 0  # steps the model loop has sent it
    progress_at: float = 0.0  # monotonic time it was last seen caught up or moving on (the watchdog's)
    last_written: int = 0


class PublisherLink:
    """The model loop's side: start the processes, send steps, collect stop-string ends."""

    def __init__(self, settings: WorkerSettings, worker_id: str):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        self.settings = settings
        self.shards: list[_Shard] = []
        self._child_ends: list[Connection] = []
        self._closing = threading.Event()
        for shard in range(settings.publishers):
            events_in, events_out = ctx.Pipe(duplex=False)
            stops_in, stops_out = ctx.Pipe(duplex=False)
            _grow(events_out)
            written = ctx.Value("q", 0, lock=False)  # one writer (the process), one reader (the watchdog)
            process = ctx.Process(
                target=run,
                args=(settings, worker_id, shard, events_in, stops_out, written),
                name=f"lightq-publisher-{worker_id}-{shard}",
                daemon=True,
            )
            self.shards.append(_Shard(process, events_out, stops_in, written))
            self._child_ends += [events_in, stops_out]

    def start(self) -> None:
        for shard in self.shards:
            shard.process.start()
        for end in self._child_ends:  # only the children hold them now: a death reads as end of file here
            end.close()
        threading.Thread(target=self._watch, name="publisher-watchdog", daemon=True).start()
        log.info("publisher processes %s started", [s.process.pid for s in self.shards])

    def _watch(self) -> None:
        """Kills a publisher that has left steps unwritten for ``--publisher_stall_s`` while Redis
        answers: the model loop then finds it dead (``put``, ``check``). A thread, because the model
        loop itself may be the one blocked (in ``put``, on a full pipe). While a shard is behind and
        not moving, Redis is asked every period: an outage restarts every clock (the publishers wait
        it out, retrying at most ``Backoff``'s cap apart, and get the whole stall time after it)."""
        client = None
        while not self._closing.wait(WATCH_PERIOD_S):
            if not self.stalled(time.monotonic(), WATCH_PERIOD_S):
                continue
            client = client or sync_client(self.settings.redis)
            try:
                client.ping()
            except Exception:
                for shard in self.shards:
                    shard.progress_at = time.monotonic()
                continue
            for shard in self.stalled(time.monotonic(), self.settings.publisher_stall_s):
                log.error(
                    "publisher process %d wrote none of %d steps in %.0f s while Redis answers: killed",
                    shard.process.pid,
                    shard.sent - shard.written.value,
                    self.settings.publisher_stall_s,
                )
                shard.process.kill()
        if client is not None:
            client.close()

    def stalled(self, now: float, for_s: float) -> list[_Shard]:
        """The live shards behind on their steps that have written none for more than ``for_s``."""
        stalled = []
        for shard in self.shards:
            written = shard.written.value
            if written >= shard.sent or written != shard.last_written or not shard.progress_at:
                shard.progress_at, shard.last_written = now, written
            elif now - shard.progress_at > for_s and shard.process.is_alive():
                stalled.append(shard)
        return stalled

    def wait_ready(self) -> None:
        """Until every publisher has its tokenizer and Redis: a worker must not take requests before
        (their first events would wait in the pipe, and a death then would find them never started,
        ``router.workers.janitor``). Called before the first heartbeat, so the loads overlap the model's."""
        for shard in self.shards:
            try:
                message = shard.stops.recv()
            except (EOFError, OSError):
                raise PublisherDied(f"publisher process {shard.process.pid} died at start") from None
            if message != READY:
                raise RuntimeError(f"publisher process {shard.process.pid} said {message!r} before it was ready")

    def put(self, events: list[Event]) -> None:
        """A step's events, stamped with the step's end (a request's ``stepped_ms``), to every shard."""
        if not events:
            return
        # Pickle, not the JSON codec: this pipe joins a process to its own children (same code,
        # never another host or version), and a step is lists the sampler made, which pickle
        # writes fastest. Anything that leaves the worker goes through shared.codec.
        data = pickle.dumps((now_ms(), events), protocol=pickle.HIGHEST_PROTOCOL)  # once for all shards
        for shard in self.shards:
            shard.sent += 1  # first: the watchdog must see a send that blocks on a full pipe
            try:
                shard.events.send_bytes(data)
            except OSError as exc:  # BrokenPipeError among them
                raise PublisherDied(f"publisher process {shard.process.pid} is gone ({exc})") from None

    def take_stopped(self) -> list[tuple[str, int, int]]:
        """(request id, choice, epoch) of samples a stop string ended, or whose writes were refused,
        since the last call: the epoch names the copy (a newer one of the request may run now)."""
        stopped: list[tuple[str, int, int]] = []
        for shard in self.shards:
            try:
                while shard.stops.poll():
                    stopped += shard.stops.recv()
            except (EOFError, OSError):
                self.check()
        return stopped

    def check(self) -> None:
        for shard in self.shards:
            if not shard.process.is_alive():
                raise PublisherDied(f"publisher process {shard.process.pid} exited with {shard.process.exitcode}")

    def close(self) -> None:
        """Publish everything sent so far, then stop the processes (at once where one is dead)."""
        self._closing.set()
        for shard in self.shards:
            if shard.process.is_alive():
                try:
                    shard.events.send(None)
                except OSError:
                    pass
        for shard in self.shards:
            shard.process.join(CLOSE_TIMEOUT_S)
            if shard.process.is_alive():
                log.warning("publisher process %d did not finish in %.0f s: killed", shard.process.pid, CLOSE_TIMEOUT_S)
                shard.process.kill()
            shard.events.close()
            shard.stops.close()


def _grow(conn: Connection) -> None:
    try:
        fcntl.fcntl(conn.fileno(), F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:  # not Linux, or above the system's pipe-max-size: the default pipe still works
        pass


def run(
    settings: WorkerSettings, worker_id: str, shard: int, events: Connection, stops: Connection, written: Synchronized
) -> None:
    """A publisher process: write its shard of each step's events until the worker closes the pipe.

    It waits for steps no longer than its next flush is due (``Publisher.wait_s``: at once for a
    first token or an end, else at the flush interval), takes every step waiting, and flushes
    what is due; the samples a stop string ended, and those of requests refused (their epoch moved
    on), go back to the model loop."""
    # Ctrl-C reaches the whole process group; the worker decides when to stop, and this
    # process must still write what the worker's drain produces, so it ignores both signals.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging()
    tokenizer = load_tokenizer(resolve(settings.model.model_dir), settings.model.weights_cache)
    client = sync_client(settings.redis)
    shards = settings.publishers
    worker = os.getppid()  # re-parented when the worker dies: then a Redis outage is not waited out
    publisher = Publisher(
        settings, client, tokenizer, worker_id, lambda rid: owner(rid, shards) == shard, lambda: os.getppid() == worker
    )
    # Connected before READY; the worker may stop (its pipe closed or ended: poll) or die meanwhile.
    if not wait_until_up(client, log, give_up=lambda: os.getppid() != worker or events.poll()):
        return
    stops.send(READY)
    flushes = steps_taken = 0
    while (steps := _next_steps(events, publisher.wait_s())) is not None:
        last = bool(steps) and steps[-1] is None
        batch = steps[:-1] if last else steps
        stopped = publisher.record(batch)
        # After the last step (the worker closed the pipe, or died) everything goes, retries bounded.
        stopped += publisher.flush(everything=last, give_up_s=ORPHAN_RETRY_S if last else None)
        flushes, steps_taken = flushes + 1, steps_taken + len(batch)
        written.value = steps_taken  # the watchdog's sign of life (``PublisherLink.stuck``)
        if stopped and not last:
            stops.send(publisher.tagged(stopped))
        if last:
            break
    client.close()
    log.info("publisher %d/%d took %d steps in %d turns", shard, shards, steps_taken, flushes)


def _next_steps(events: Connection, wait_s: float | None) -> list | None:
    """The waiting steps (waiting up to ``wait_s`` for the first; None: as long as it takes), or
    None at the end. A list that ends with None is the last one: the worker closed the pipe after
    those steps. An empty list: nothing came in time."""
    steps: list = []
    try:
        if wait_s is not None and not events.poll(wait_s):
            return steps
        steps.append(events.recv())
        while steps[-1] is not None and len(steps) < MAX_STEPS_PER_WRITE and events.poll():
            steps.append(events.recv())
    except EOFError:  # the worker is gone: write what arrived, then stop
        return [*steps, None]
    return steps
