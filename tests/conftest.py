"""Shared fixtures: a real Redis (the local one, or an embedded one) with a
key prefix of its own per test, removed afterwards; the session fails if its
tests left keys without a TTL in the local Redis (``redis_left_clean``)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import uuid

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU interpreter; this must precede any triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import redis

from shared.config import RedisSettings
from shared.embedded_redis import start_embedded_redis
from shared.keys import Keys
from shared.redis import answers

LOCAL_URL = os.environ.get("LIGHTQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# `make test-fast` runs -m "not integration and not slow". Marked here by node id prefix (a folder, a
# module, or a test) rather than in each file; seconds from --durations on a 2-core machine.
INTEGRATION = (  # starts real processes or the whole stack
    "tests/integration/",  # lightq serve and the whole stack
    "tests/batches/test_e2e_batch.py",  # the stack, and `lightq batch submit` (60 s)
    "tests/batches/test_rq_worker_process.py",  # rq worker processes (85 s)
    "tests/producer/test_producers.py::test_two_processes",  # producer.main with its children (60 s)
    "tests/producer/test_producers.py::test_children_stop",
    "tests/worker/test_tp_engine.py",  # tensor-parallel follower processes (50 s)
    "tests/worker/test_models_tp.py",  # torch.multiprocessing ranks (70 s)
    "tests/worker/test_publisher.py::test_the_publisher_processes",  # publisher processes (80 s)
    "tests/worker/test_publisher.py::test_a_dead_publisher_process",
    "tests/worker/test_drain.py",  # a worker service with its publisher processes (35 s)
    "tests/monitoring/test_top.py::test_cli_once",  # `lightq top` in a subprocess
    "tests/router/test_dead_letters.py::test_cli_lists",  # `lightq dead-letters` in a subprocess
)
LONG = (  # in-process, but long: marked slow
    "tests/producer/test_fuzz.py",  # schemathesis over the whole API (80 s)
    "tests/worker/test_engine_groups.py::test_paused_samples_recompute",  # (45 s)
    "tests/worker/test_engine.py::test_past_future_overcommits",  # (20 s)
    "tests/worker/test_group_resume.py::test_requeued_greedy_group",  # 14 cases (25 s)
    "tests/worker/test_group_resume.py::test_requeued_seeded_group",  # (5 s)
    "tests/worker/test_group_resume.py::test_a_poisoned_seed",  # (5 s)
    "tests/worker/test_publisher.py::test_an_orphaned_publisher",  # retries a dead Redis (8 s)
    # ALiBi and window rules over grids, under Triton's CPU interpreter (50 s); the kernels' own
    # reference tests stay in the fast set
    "tests/kernels/test_position_rules.py::test_context_attention_rules",
    "tests/kernels/test_position_rules.py::test_decode_attention_rules",
)


def pytest_configure(config):
    """One dequantisation of the embedded GGUF a session: every stack's workers read it back
    (``worker.model.gguf_cache``) from a folder of the session's, removed at its end."""
    if "LIGHTQ_WEIGHTS_CACHE" not in os.environ:
        config.lightq_weights = os.environ["LIGHTQ_WEIGHTS_CACHE"] = tempfile.mkdtemp(prefix="lightq-test-weights-")


def pytest_unconfigure(config):
    if getattr(config, "lightq_weights", None):
        shutil.rmtree(config.lightq_weights, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def redis_url():
    """The local Redis when one answers, else an embedded one for the session."""
    if answers(LOCAL_URL):
        yield LOCAL_URL
        return
    server = start_embedded_redis()
    try:
        yield server.url
    finally:
        server.stop()


TEST_PREFIX = re.compile(r"lightq-test-[0-9a-f]{10}")  # redis_settings' prefixes (also in rq names)


@pytest.fixture(scope="session")
def session_prefixes() -> set[str]:
    """The key prefixes this session's tests were given (redis_settings)."""
    return set()


@pytest.fixture(scope="session", autouse=True)
def redis_left_clean(session_prefixes):
    """Fails the session (an error at its last teardown) when its tests left keys without a TTL
    in the shared local Redis; keys with a TTL go by themselves. What others write meanwhile is
    left out: keys of other test sessions (their ``lightq-test-<hex>`` prefix was not given here),
    and keys under a namespace that had keys before the session (a ``lightq serve`` of the user's
    on the same Redis), unless they carry one of this session's prefixes (rq keys name them).
    An embedded Redis goes with the session: nothing to check."""
    if not answers(LOCAL_URL):
        yield
        return
    client = redis.Redis.from_url(LOCAL_URL, decode_responses=True)
    before = set(client.scan_iter(count=1000))
    namespaces = {key.partition(":")[0] for key in before}
    yield
    new = set(client.scan_iter(count=1000)) - before
    leaked = sorted(key for key in new if client.ttl(key) == -1 and _ours(key, session_prefixes, namespaces))
    client.close()
    assert not leaked, f"tests left {len(leaked)} keys without a TTL in {LOCAL_URL}: {leaked[:20]}"


def _ours(key: str, mine: set[str], namespaces: set[str]) -> bool:
    prefixes = TEST_PREFIX.findall(key)
    if prefixes:
        return any(prefix in mine for prefix in prefixes)
    return key.partition(":")[0] not in namespaces


@pytest.fixture
def redis_settings(redis_url, session_prefixes) -> RedisSettings:
    prefix = f"lightq-test-{uuid.uuid4().hex[:10]}"
    session_prefixes.add(prefix)
    settings = RedisSettings(url=redis_url, key_prefix=prefix)
    yield settings
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def keys(redis_settings) -> Keys:
    return Keys(redis_settings.key_prefix)


@pytest.fixture
def rclient(redis_settings):
    client = redis.Redis.from_url(redis_settings.url, decode_responses=True)
    yield client
    client.close()


def keys_with_prefix(client: redis.Redis, prefix: str) -> list[str]:
    """Every key under a test's prefix: for 'leaves no trace' checks."""
    return sorted(client.scan_iter(match=f"{prefix}:*", count=1000))


@pytest.fixture
async def proxy(redis_url):
    """A TCP proxy in front of the test Redis that a test can cut (an outage on demand)."""
    from tests.producer.redis_proxy import RedisProxy

    proxy = RedisProxy(redis_url)
    await proxy.start()
    yield proxy
    await proxy.cut()
