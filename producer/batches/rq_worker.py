"""``lightq rq-worker``: rq's side of lightq (batch jobs and housekeeping), one service.

Two rq workers, because rq runs one job at a time per worker: this process
runs batch jobs (queue ``--batch_queue``), each in a forked job process; a
child process runs the housekeeping queue (``--housekeeping_queue``) with
rq's scheduler, so a batch that takes hours never holds housekeeping up.

Housekeeping (``shared.housekeeping``, plus retrying abandoned batch jobs)
reschedules itself every ``--housekeeping_interval_s`` with ``enqueue_at``,
under one job id per time slot and ``unique=True``: any number of rq-worker
replicas keep a single chain, and each one's start revives a broken chain.

A Redis outage (a restart) ends an rq worker's loop, and its scheduler
process with it; each worker here is started again once Redis answers
(``work_through_outages``), and the janitor's worker restarts a scheduler
that died under it at its next maintenance (``JanitorWorker``), so
housekeeping carries on after Redis comes back.

On SIGTERM the batch worker stops at once instead of waiting for its job
(rq's warm shutdown, which could take hours): it kills the job process, puts
the job back at the front of its queue (no retry spent) and exits; the next
rq worker resumes the batch where it was (``producer.batches.job``). A worker
that dies (SIGKILL, a crash) leaves its job in rq's started registry until its
heartbeat lapses; housekeeping then finds it abandoned and rq retries it
(``Retry``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import re
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from rq import Queue, SimpleWorker, Worker
from rq.exceptions import DuplicateJobError, NoSuchJobError
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now

from shared.config import RqWorkerSettings
from shared.housekeeping import run_all
from shared.redis import OUTAGES, REDIS_FAILURES, answers, sync_client
from shared.service import die_with_parent, setup_logging

log = logging.getLogger("lightq.rq")


class QuickUnsubscribe:
    """rq's ``unsubscribe`` (at a worker's teardown), without waiting up to a minute on its pubsub thread.

    rq runs its pubsub listener with ``run_in_thread(sleep_time=60)`` and calls the thread's ``stop()``
    at teardown; since redis-py 8, ``stop()`` joins the thread until it exits, and a thread that came
    back from its read before the flag was cleared sits in ``get_message``'s wait for a subscription
    for the whole 60 s: a stop (serve's, on SIGTERM) hung that long, then ``lightq serve`` killed the
    process. The thread is a daemon that only listens for rq's commands; here it is told to stop and
    waited for 1 s at most (rq's own bound after ``stop()``), then the connection closes."""

    pubsub: Any
    pubsub_thread: Any
    pubsub_channel_name: str
    name: str
    log: logging.Logger

    def unsubscribe(self) -> None:
        if self.pubsub_thread:
            self.log.info("Worker %s: unsubscribing from channel %s", self.name, self.pubsub_channel_name)
            self.pubsub.unsubscribe()
            try:
                self.pubsub_thread.stop(timeout=1)  # redis-py >= 8: stop() joins, for as long as it is given
            except TypeError:  # older redis-py: stop() only clears the flag
                self.pubsub_thread.stop()
                self.pubsub_thread.join(timeout=1)
            self.pubsub.close()


class BatchWorker(QuickUnsubscribe, Worker):
    """rq's forking worker, except that the first SIGTERM or SIGINT is a cold shutdown (see above),
    and the job it stopped goes back to the front of its queue at once, its retries untouched: a
    clean stop is no crash. (Left started, it waited a minute or two for its heartbeat to lapse
    and then spent one of its ``--batch_retries``: three clean restarts of serve failed a batch.)"""

    stopped_job_id: str | None = None

    def request_stop(self, signum, frame):
        self._shutdown_requested_date = now() - timedelta(seconds=2)  # rq ignores a repeat within 1 s
        # No Redis call here: the signal may have interrupted one (its pool's lock held), and Redis
        # may be gone (serve's, at its death). rq's ``get_current_job_id`` asks Redis when idle, so
        # the job is read from the worker's own memory; ``teardown`` puts it back once rq's loop
        # has unwound.
        running = list(self.executions.values())
        self.stopped_job_id = running[0].job_id if running else None
        self.request_force_stop(signum, frame)  # kills the job process, waits for it, SystemExit

    def teardown(self):
        if self.stopped_job_id is not None and not self.is_horse:
            self.put_back(self.stopped_job_id)
        super().teardown()

    def put_back(self, job_id: str) -> None:
        """The stopped job queued again (its process is gone): it resumes from its batch's records."""
        try:
            job = self.job_class.fetch(job_id, connection=self.connection, serializer=self.serializer)
            StartedJobRegistry(job.origin, connection=self.connection).remove_executions(job)
            Queue(job.origin, connection=self.connection, serializer=self.serializer).enqueue_job(job, at_front=True)
            self.log.info("batch job %s put back in its queue: the next rq worker resumes it", job_id)
        except NoSuchJobError:  # removed meanwhile (its batch expired): nothing to resume
            return
        except REDIS_FAILURES as exc:  # Redis gone: housekeeping finds it abandoned later, as after a crash
            self.log.warning("batch job %s could not be put back (%s): it is retried once abandoned", job_id, exc)


class JanitorWorker(QuickUnsubscribe, SimpleWorker):
    """rq's in-process worker whose maintenance also revives a dead scheduler at once.

    rq restarts a dead scheduler process only if it can take the scheduler lock, and the lock
    of one that died in an outage stays in Redis (persisted) for a minute; it is this worker's
    own scheduler's lock, so it is released first. (``_process`` is rq's; rq has no accessor.)
    """

    def run_maintenance_tasks(self):
        scheduler = self.scheduler
        if scheduler is not None and scheduler._process is not None and not scheduler._process.is_alive():
            log.warning("rq scheduler (pid %s) is gone: starting another", scheduler._process.pid)
            scheduler.release_locks()
            scheduler._process = None
        super().run_maintenance_tasks()


def queue(name: str, connection: redis.Redis) -> Queue:
    """An rq queue of lightq's: JSON job arguments (never pickle)."""
    return Queue(name, connection=connection, serializer=JSONSerializer)


def run(settings: RqWorkerSettings) -> None:
    """The service: the housekeeping child first (before anything else starts threads), then batches."""
    setup_logging()
    if not settings.redis.batch_url:
        raise SystemExit(
            "lightq rq-worker: rq has no Redis Cluster client; name a plain Redis for its queue with --redis_rq_url"
        )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # job processes are forked from this one
    janitor = multiprocessing.get_context("fork").Process(
        target=run_janitor, args=(settings.model_dump(mode="json"),), name="lightq-janitor"
    )
    janitor.start()
    lost, stopping = threading.Event(), threading.Event()
    args = (janitor, lost, stopping)
    threading.Thread(target=watch_janitor, args=args, name="janitor-watch", daemon=True).start()
    connection = redis.Redis.from_url(settings.redis.batch_url)
    try:
        from producer.batches.job import tokenizer_for

        tokenizer_for(settings.model)  # once here; every forked job process has it
        batch_queue = queue(settings.batch.queue, connection)
        work_through_outages(
            settings.redis.batch_url,
            lambda: BatchWorker([batch_queue], connection=connection, serializer=JSONSerializer),
        )
    finally:
        stopping.set()  # before the janitor ends: its watcher must not take our own stop for a death
        janitor.terminate()
        janitor.join(timeout=10)
        end_group(janitor)
        connection.close()
        if lost.is_set():  # in place of rq's own exit (a cold stop raises SystemExit with code 0)
            raise SystemExit("lightq rq-worker: its housekeeping child died; exiting so that both start again")


def watch_janitor(
    janitor: multiprocessing.process.BaseProcess, lost: threading.Event, stopping: threading.Event
) -> None:
    """A janitor that dies ends this process too (its batch job first, rq's warm stop), with an error,
    so that whoever runs it (lightq serve, a container's restart policy) starts both again: forking a
    new janitor from here, with the batch worker's threads running, is not safe. A dead janitor
    would stop the housekeeping for good, and acknowledged ingress entries pile up unbounded.

    ``stopping`` is set by our own stop before it ends the janitor: then the main thread's join may
    reap the child first, and this thread's join returns with exitcode None (waitpid's ECHILD)."""
    janitor.join()
    end_group(janitor)
    if stopping.is_set():
        return
    if janitor.exitcode not in (0, -signal.SIGTERM):  # not our own stop
        log.error("the housekeeping child exited with %s: stopping this rq worker", janitor.exitcode)
        lost.set()
        os.kill(os.getpid(), signal.SIGTERM)


def end_group(janitor: multiprocessing.process.BaseProcess) -> None:
    """Ends the janitor's process group: rq's scheduler process, forked from it, outlives it otherwise."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(janitor.pid, signal.SIGTERM)


def run_janitor(settings: dict) -> None:
    """The housekeeping worker (with rq's scheduler), in the child process."""
    die_with_parent()
    # A group of its own, which rq's scheduler process (forked from this one) joins: a janitor that
    # dies (SIGKILL) would leave that orphan holding the scheduler's lock for ever; its watcher ends
    # the group (``watch_janitor``).
    os.setpgid(0, 0)
    parsed = RqWorkerSettings.model_validate(settings)
    connection = redis.Redis.from_url(parsed.redis.batch_url)
    janitor_queue = queue(parsed.housekeeping.queue, connection)
    interval = parsed.housekeeping.interval_s

    def janitor() -> JanitorWorker:
        schedule_housekeeping(janitor_queue, parsed, time.time())  # revives a chain broken by an outage
        # Maintenance (and the scheduler check in it) runs between dequeues: at least every interval.
        return JanitorWorker(
            [janitor_queue],
            connection=connection,
            serializer=JSONSerializer,
            worker_ttl=interval + 15,
            maintenance_interval=interval,
        )

    # Its jobs are the housekeeping every interval: rq's INFO lines for each (4 a minute) were a third
    # of an idle serve's log. Warnings and errors still show; LIGHTQ_LOG_LEVEL=DEBUG shows them all.
    quiet = "DEBUG" if os.environ.get("LIGHTQ_LOG_LEVEL", "INFO").upper() == "DEBUG" else "WARNING"
    work_through_outages(parsed.redis.batch_url, janitor, with_scheduler=True, logging_level=quiet)


def work_through_outages(url: str, make_worker, **work_args) -> None:
    """Run an rq worker until it is asked to stop; one that quit in a Redis outage (rq's loop
    quits on most Redis errors) is replaced by a new one when Redis answers again."""
    while True:
        worker = None
        try:
            worker = make_worker()
            work_args.setdefault("logging_level", os.environ.get("LIGHTQ_LOG_LEVEL", "INFO"))
            worker.work(**work_args)
        except OUTAGES as exc:
            log.warning("rq worker: Redis unreachable (%s): starting again when it answers", exc)
        if worker is not None and worker._shutdown_requested_date is not None:  # SIGTERM/SIGINT (rq's own)
            return
        time.sleep(1.0)  # whatever ended the loop, never spin on it
        while not answers(url):
            time.sleep(1.0)
        if worker is not None and worker.scheduler is not None:
            # Its scheduler died with it; its lock (persisted, a minute's TTL) would keep the next out.
            try:
                worker.scheduler.release_locks()
            except REDIS_FAILURES:
                pass


def housekeeping_job_id(prefix: str, slot: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', prefix)}-housekeeping-{slot}"


def schedule_housekeeping(janitor_queue: Queue, settings: RqWorkerSettings, at: float) -> bool:
    """Schedule the run of the interval slot holding ``at`` (at the slot's start); False if it exists."""
    interval = settings.housekeeping.interval_s
    slot = int(at // interval)
    try:
        janitor_queue.enqueue_at(
            datetime.fromtimestamp(slot * interval, tz=timezone.utc),
            housekeeping,
            settings.model_dump(mode="json"),
            job_id=housekeeping_job_id(settings.redis.key_prefix, slot),
            unique=True,
            result_ttl=3 * interval,
            failure_ttl=86_400,
            job_timeout=max(interval, 60),
        )
        return True
    except DuplicateJobError:
        return False


def housekeeping(settings: dict) -> dict:
    """The periodic job: the next run is scheduled first, so a failure here cannot end the chain."""
    parsed = RqWorkerSettings.model_validate(settings)
    connection = redis.Redis.from_url(parsed.redis.batch_url)
    client = sync_client(parsed.redis)
    try:
        schedule_housekeeping(
            queue(parsed.housekeeping.queue, connection), parsed, time.time() + parsed.housekeeping.interval_s
        )
        done = run_all(
            client,
            parsed.redis.keys,
            ttl_s=parsed.redis.request_ttl_s,
            stale_worker_s=parsed.housekeeping.stale_worker_s,
            scan_count=parsed.housekeeping.scan_count,
        )
        done["batch_jobs_retried"] = retry_abandoned(queue(parsed.batch.queue, connection))
        if (
            done["ingress_trimmed"]
            or done["workers_dropped"]
            or done["batch_jobs_retried"]
            or any(done["request_records"].values())
        ):
            log.info("housekeeping: %s", done)
        return done
    finally:
        client.close()
        connection.close()


def retry_abandoned(batch_queue: Queue) -> int:
    """Batch jobs whose worker died: rq retries them (or fails them once out of retries)."""
    registry = StartedJobRegistry(queue=batch_queue)
    abandoned = len(registry.get_expired_job_ids())
    if abandoned:
        registry.cleanup()
    return abandoned
