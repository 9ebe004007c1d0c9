"""``lightq rq-worker``: rq's side of lightq (batch jobs and housekeeping), one service.

Two rq workers, because rq runs one job at a time per worker: this process
runs batch jobs (queue ``--batch_queue``), each in a forked job process; a
child process runs the housekeeping queue (``--housekeeping_queue``) with
rq's scheduler, so a batch that takes hours never holds housekeeping up.

Housekeeping (``shared.housekeeping``, plus retrying abandoned batch jobs)
reschedules itself every ``--housekeeping_interval_s`` with ``enqueue_at``,
under one job id per time slot and ``unique=True``: any number of rq-worker
replicas keep a single chain, and each one's start revives a broken chain.

On SIGTERM the batch worker stops at once instead of waiting for its job
(rq's warm shutdown, which could take hours): it kills the job process and
exits. The job stays in rq's started registry until its heartbeat lapses;
housekeeping then finds it abandoned, rq retries it (``Retry``), and the
batch resumes where it was (``producer.batch_job``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import time
from datetime import datetime, timedelta, timezone

import redis
from rq import Queue, SimpleWorker, Worker
from rq.exceptions import DuplicateJobError
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import now

from shared.config import RqWorkerSettings
from shared.housekeeping import run_all
from shared.keys import Keys
from shared.redis import sync_client
from shared.service import setup_logging

log = logging.getLogger("lightq.rq")


class BatchWorker(Worker):
    """rq's forking worker, except that the first SIGTERM or SIGINT is a cold shutdown (see above)."""

    def request_stop(self, signum, frame):
        self._shutdown_requested_date = now() - timedelta(seconds=2)  # rq ignores a repeat within 1 s
        self.request_force_stop(signum, frame)


def queue(name: str, connection: redis.Redis) -> Queue:
    """An rq queue of lightq's: JSON job arguments (never pickle)."""
    return Queue(name, connection=connection, serializer=JSONSerializer)


def run(settings: RqWorkerSettings) -> None:
    """The service: the housekeeping child first (before anything else starts threads), then batches."""
    setup_logging()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # job processes are forked from this one
    janitor = multiprocessing.get_context("fork").Process(
        target=run_janitor, args=(settings.model_dump(mode="json"),), name="lightq-janitor")
    janitor.start()
    connection = redis.Redis.from_url(settings.redis.url)
    try:
        from producer.batch_job import tokenizer_for

        tokenizer_for(settings.model.model_dir)  # once here; every forked job process has it
        worker = BatchWorker([queue(settings.batch.queue, connection)], connection=connection,
                             serializer=JSONSerializer)
        worker.work(logging_level=os.environ.get("LIGHTQ_LOG_LEVEL", "INFO"))
    finally:
        janitor.terminate()
        janitor.join(timeout=10)
        connection.close()


def run_janitor(settings: dict) -> None:
    """The housekeeping worker (with rq's scheduler), in the child process."""
    _die_with_parent()
    parsed = RqWorkerSettings.model_validate(settings)
    connection = redis.Redis.from_url(parsed.redis.url)
    janitor_queue = queue(parsed.housekeeping.queue, connection)
    schedule_housekeeping(janitor_queue, parsed, time.time())
    worker = SimpleWorker([janitor_queue], connection=connection, serializer=JSONSerializer)
    worker.work(with_scheduler=True, logging_level=os.environ.get("LIGHTQ_LOG_LEVEL", "INFO"))


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def housekeeping_job_id(prefix: str, slot: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', prefix)}-housekeeping-{slot}"


def schedule_housekeeping(janitor_queue: Queue, settings: RqWorkerSettings, at: float) -> bool:
    """Schedule the run of the interval slot holding ``at`` (at the slot's start); False if it exists."""
    interval = settings.housekeeping.interval_s
    slot = int(at // interval)
    try:
        janitor_queue.enqueue_at(
            datetime.fromtimestamp(slot * interval, tz=timezone.utc), housekeeping, settings.model_dump(mode="json"),
            job_id=housekeeping_job_id(settings.redis.key_prefix, slot), unique=True,
            result_ttl=3 * interval, failure_ttl=86_400, job_timeout=max(interval, 60))
        return True
    except DuplicateJobError:
        return False


def housekeeping(settings: dict) -> dict:
    """The periodic job: the next run is scheduled first, so a failure here cannot end the chain."""
    parsed = RqWorkerSettings.model_validate(settings)
    connection = redis.Redis.from_url(parsed.redis.url)
    client = sync_client(parsed.redis)
    try:
        schedule_housekeeping(queue(parsed.housekeeping.queue, connection), parsed,
                              time.time() + parsed.housekeeping.interval_s)
        done = run_all(client, Keys(parsed.redis.key_prefix), ttl_s=parsed.redis.request_ttl_s,
                       stale_worker_s=parsed.housekeeping.stale_worker_s,
                       scan_count=parsed.housekeeping.scan_count)
        done["batch_jobs_retried"] = retry_abandoned(queue(parsed.batch.queue, connection))
        if done["ingress_trimmed"] or done["workers_dropped"] or done["batch_jobs_retried"] or \
                any(done["request_records"].values()):
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
