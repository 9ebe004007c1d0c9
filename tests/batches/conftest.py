"""Batch fixtures: the producer app on the test's own key prefix and rq queues
of its own (rq keeps its keys under ``rq:``, so they are removed by name
afterwards), an in-process rq worker, and the fake worker from the producer
tests playing the pool's side."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
import redis
from rq.serializers import JSONSerializer

from producer.batches import job as batch_job
from producer.batches.rq_worker import queue
from shared.config import BatchSettings, HousekeepingSettings, ModelSettings, RqWorkerSettings
from shared.producer_settings import ProducerSettings
from tests.batches.helpers import ThreadWorker

# The producer's app, client, async Redis and fake-worker fixtures, on this folder's settings.
from tests.producer.conftest import app, aredis, client, worker  # noqa: F401


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer  # loaded once a session (tests/conftest.py)
    batch_job._tokenizers["default"] = tok  # the in-process job uses this one too
    return tok


@pytest.fixture
def rq_names(redis_settings):
    """rq queue names of this test's own; every rq key naming them (or the test's prefix) goes afterwards."""
    tag = redis_settings.key_prefix
    yield SimpleNamespace(batch=f"{tag}-batch", janitor=f"{tag}-janitor", tag=tag)
    client = redis.Redis.from_url(redis_settings.url)
    stale = list(client.scan_iter(match=f"rq:*{tag}*", count=1000))
    if stale:
        client.delete(*stale)
    for member in client.smembers("rq:queues"):
        if tag.encode() in member:
            client.srem("rq:queues", member)
    # rq's own registry of workers (a killed one never deregisters) and the records of ours, which rq
    # keeps a minute after a worker stops: ours by the queues they name, and members whose record is gone
    for member in client.smembers("rq:workers"):
        if not client.exists(member):
            client.srem("rq:workers", member)
    for key in client.scan_iter(match="rq:worker:*", count=1000):
        if client.type(key) == b"hash" and tag.encode() in (client.hget(key, "queues") or b""):
            client.srem("rq:workers", key)
            client.delete(key)
    client.close()


@pytest.fixture
def settings(redis_settings, rq_names) -> ProducerSettings:
    return ProducerSettings(
        redis=redis_settings,
        model=ModelSettings(max_req_total_len=2048),
        default_max_new_tokens=16,
        stream_block_ms=100,
        batch=BatchSettings(queue=rq_names.batch, max_in_flight=2, retries=1),
    )


@pytest.fixture
def rq_settings(redis_settings, rq_names) -> RqWorkerSettings:
    return RqWorkerSettings(
        redis=redis_settings,
        batch=BatchSettings(queue=rq_names.batch),
        housekeeping=HousekeepingSettings(queue=rq_names.janitor, interval_s=1),
    )


@pytest.fixture
def rq_conn(redis_settings):
    connection = redis.Redis.from_url(redis_settings.url)
    yield connection
    connection.close()


@pytest.fixture
def run_rq(rq_conn, rq_names):
    """``await run_rq()``: an rq worker in a thread works a queue (the batch one) until it is empty."""

    async def run(queue_name: str | None = None, **work) -> bool:
        worker = ThreadWorker(
            [queue(queue_name or rq_names.batch, rq_conn)],
            connection=rq_conn,
            name=f"{rq_names.tag}-{uuid.uuid4().hex[:6]}",
            serializer=JSONSerializer,
        )
        return await asyncio.to_thread(worker.work, burst=True, logging_level="WARNING", **work)

    return run
