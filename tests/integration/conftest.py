"""The ``lightq serve`` stacks only tests/integration shares between its modules (tests/stack_order.py
runs each one's tests one after another and stops it after the last): ``smollm2_single``, ``counting_trio``
and ``counting_cluster``; tests/conftest.py keeps ``smollm2_pair``, which tests/batches uses too."""

from __future__ import annotations

import uuid

import pytest

from shared.embedded_redis import start_embedded_redis
from tests.stack_order import last_user


@pytest.fixture(scope="session")
def smollm2_single(tmp_path_factory, redis_url, smollm2_weights):
    """``lightq serve`` with 1 worker on the embedded SmolLM2, for the real clients
    (tests/integration/test_openai_stack.py, test_structured_stack.py, test_structured_hardening.py,
    test_readme_clients.py), on a Redis Cluster of 3 primaries of its own (issue 30: the SmolLM2 path on a
    cluster, where ``smollm2_pair``'s e2e suite keeps one node; not the session's ``redis_cluster``,
    whose tests flush it and kill its nodes), rq's queue on the test Redis as a cluster deployment has
    it. Where no redis-server >= 7 is installed, on the test Redis. Its keys and cluster go afterwards."""
    from tests.cluster import LocalCluster
    from tests.integration.stack import COMPILE_TIMEOUT_S, SharedStack, Stack, remove_prefix_keys, start_stack

    log = str(tmp_path_factory.mktemp("smollm2-single") / "serve.log")
    try:
        cluster: LocalCluster | None = LocalCluster(replicas=0)
    except RuntimeError as exc:  # no redis-server >= 7: the cluster tests skip, this stack takes a node
        print(f"smollm2_single on the test Redis: {exc}")
        cluster = None
    prefix = f"lightq-oai-{uuid.uuid4().hex[:8]}"

    def start():
        extra = ["--max_total_token_num", "8192", "--max_req_total_len", "1024"]
        # A compile past 10 s fails (serve's default: 30): test_structured_hardening's costly schemas
        # compiled in under 30 s on a fast 2-core machine and were not refused; the others' take ms.
        extra += ["--grammar_compile_timeout_s", str(COMPILE_TIMEOUT_S)]
        if cluster is None:
            return start_stack(log, redis_url=redis_url, prefix=prefix, workers=1, extra=extra)
        cluster.start()
        extra += ["--redis_rq_url", redis_url]
        try:
            return start_stack(log, redis_url=cluster.url, prefix=prefix, workers=1, extra=extra)
        except BaseException:
            cluster.stop()
            raise

    def close(stack):
        if cluster is None:
            return Stack.close(stack)
        try:
            assert stack.stop() == 0, open(log).read()[-3000:]
        finally:
            cluster.stop()
            remove_prefix_keys(redis_url, prefix)  # rq's; the cluster's keys went with it

    shared = SharedStack(start, close, workers=1)
    yield shared
    shared.close()


@pytest.fixture
def smollm2_single_stack(smollm2_single, request):
    yield smollm2_single.get()
    if last_user("smollm2_single", request):
        smollm2_single.close()


@pytest.fixture(scope="session")
def counting_trio(tmp_path_factory):
    """``lightq serve`` with 3 workers on the counting model (every output known in advance) and an
    append-only embedded Redis of its own (``counting_trio.redis_server``, which a test restarts), for
    the chaos tests (tests/integration/test_chaos.py, test_publisher_crash.py)."""
    from tests.integration.stack import COUNTING_STEP_MS, DRAIN_TIMEOUT_S, SharedStack, start_stack

    log = str(tmp_path_factory.mktemp("counting-trio") / "serve.log")

    def start():
        shared.redis_server = start_embedded_redis(appendonly=True)
        extra = ["--model_dir", "counting", "--max_total_token_num", "60000", "--max_req_total_len", "1100"]
        extra += ["--liveness_ttl_s", "1.5", "--drain_timeout", str(DRAIN_TIMEOUT_S)]
        extra += ["--counting_step_ms", str(COUNTING_STEP_MS), "--publisher_stall_s", "5"]
        try:
            return start_stack(log, redis_url=shared.redis_server.url, prefix="lightq-chaos", workers=3, extra=extra)
        except BaseException:
            shared.redis_server.stop()
            raise

    def close(stack):
        try:
            stack.stop()
        finally:
            shared.redis_server.stop()

    shared = SharedStack(start, close, workers=3)
    yield shared
    shared.close()


@pytest.fixture
def counting_trio_stack(counting_trio, request):
    yield counting_trio.get()
    if last_user("counting_trio", request):
        counting_trio.close()


@pytest.fixture(scope="session")
def counting_cluster(tmp_path_factory, redis_url):
    """``lightq serve`` with 2 counting-model workers on a Redis Cluster of its own (3 primaries, 3
    replicas: ``counting_cluster.cluster``, whose primaries the tests kill), rq's queue on the session's
    plain Redis (``--redis_rq_url``), for tests/integration/test_cluster.py. Skipped where no
    redis-server >= 7 is installed."""
    from tests.cluster import LocalCluster
    from tests.integration.stack import COUNTING_STEP_MS, DRAIN_TIMEOUT_S, SharedStack, remove_prefix_keys, start_stack

    try:
        cluster = LocalCluster(appendonly=True)  # the whole-cluster restart keeps every request
    except RuntimeError as exc:
        pytest.skip(str(exc))
    log = str(tmp_path_factory.mktemp("counting-cluster") / "serve.log")
    prefix = f"lightq-cluster-{uuid.uuid4().hex[:6]}"

    def start():
        cluster.start()
        extra = ["--model_dir", "counting", "--max_total_token_num", "60000", "--max_req_total_len", "1100"]
        extra += ["--liveness_ttl_s", "3", "--drain_timeout", str(DRAIN_TIMEOUT_S), "--redis_rq_url", redis_url]
        extra += ["--counting_step_ms", str(COUNTING_STEP_MS)]
        try:
            return start_stack(log, redis_url=cluster.url, prefix=prefix, workers=2, extra=extra)
        except BaseException:
            cluster.stop()
            raise

    def close(stack):
        try:
            stack.stop()
        finally:
            cluster.stop()
            remove_prefix_keys(redis_url, prefix)

    shared = SharedStack(start, close, workers=2)
    shared.cluster = cluster  # type: ignore[attr-defined]
    yield shared
    shared.close()


@pytest.fixture
def counting_cluster_stack(counting_cluster, request):
    if counting_cluster.cluster.nodes:  # a primary an earlier test killed comes back (as a replica)
        counting_cluster.cluster.heal()
    yield counting_cluster.get()
    if last_user("counting_cluster", request):
        counting_cluster.close()
