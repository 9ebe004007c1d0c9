"""``lightq serve``'s start as a user meets it, with real processes: bad
settings fail before anything starts, a child failing at start-up ends serve
with its error, restarts back off and only start-up failures in a row give up,
and joining a pool that already serves says so (the life cycle after the
start: test_serve_lifecycle.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from lightq.children import Child
from shared.embedded_redis import free_port
from shared.keys import Keys
from tests.integration.test_serve_lifecycle import WAIT_S, serve_env

pytestmark = pytest.mark.slow


def run_serve(args: list[str], data_dir: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightq.cli", "serve", "--port", str(free_port()), *args],
        env={**serve_env(data_dir), **(env or {})},
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


@pytest.mark.parametrize(
    "args, env, says",
    [
        (["--model_dir", "/nonexistent/model"], {}, "--model_dir /nonexistent/model: no such file or directory"),
        (["--model_dir", "HuggingFaceTB/SmolLM2-135M-Instruct"], {}, "hubs are not reachable"),
        (
            [],
            {"LIGHTQ_REJECT_WITHOUT_WORKERS": "maybe"},  # (as a flag it is a switch: argparse refuses a value)
            "--reject_without_workers (env LIGHTQ_REJECT_WITHOUT_WORKERS): input should be a valid boolean",
        ),
        (["--device", "cuda"], {}, "--device cuda: CUDA is not available"),
        # A key list that holds no key served everyone without one; the key is never echoed.
        ([], {"LIGHTQ_API_KEYS": ",,,"}, "--api_keys is set but holds no key"),
        ([], {"LIGHTQ_API_KEYS": "team-a:,team-b:sk-secret"}, "'team-a:' names a tenant and no key"),
        (["--redis_url", "garbage"], {}, "--redis_url (env LIGHTQ_REDIS_URL): string should match pattern"),
        (["--workers", "2", "--worker_id", "w1"], {}, "--worker_id names one worker; --workers 2 start several"),
    ],
)
def test_a_bad_setting_is_one_line_and_nothing_starts(tmp_path, args, env, says):
    if args[:1] == ["--device"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    done = run_serve(args, str(tmp_path / "data"), env)
    assert done.returncode != 0
    output = (done.stdout + done.stderr).strip()
    assert len(output.splitlines()) == 1 and output.startswith("lightq: "), output
    assert says in output and "sk-secret" not in output
    assert not (tmp_path / "data").exists(), "nothing (not even Redis) may start"


def test_a_child_failing_at_startup_ends_serve_with_its_error(tmp_path):
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # there, so the parent's check passes; no model loads from it
    done = run_serve(["--model_dir", str(model)], str(tmp_path / "data"))
    assert done.returncode != 0
    error = done.stderr[done.stderr.index("failed at start-up 3 times in a row") :]
    assert "Error" in error, error  # the child's own last lines come with it
    assert "lightq: stopping:" in error


def test_joining_a_pool_says_what_already_serves_it(redis_settings, rclient, caplog):
    from lightq.serve_redis import open_redis
    from shared import codec
    from shared.worker_load import WorkerLoad

    keys = Keys(redis_settings.key_prefix)
    load = WorkerLoad(
        worker_id="other-host-1",
        seq=1,
        ts_ms=int(time.time() * 1000),
        max_total_tokens=8192,
        used_tokens=0,
        committed_tokens=0,
        num_running=0,
        num_waiting=0,
        requests=[],
    )
    rclient.set(keys.load(load.worker_id), codec.encode(load), ex=60)
    rclient.zadd(keys.workers(), {load.worker_id: load.ts_ms})
    flags = {"redis_url": redis_settings.url, "redis_key_prefix": redis_settings.key_prefix}
    with caplog.at_level("INFO", logger="lightq.serve"):
        store = open_redis(flags, data_dir="", http_port=free_port())
    assert store.url == redis_settings.url and store.embedded is None  # an explicit URL that answers: joined
    assert "joining the pool" in caplog.text and "1 live worker(s)" in caplog.text and "other-host-1" in caplog.text


def exited_child(code: int | None) -> Child:
    """A real child that exited with ``code``, or was killed (None: SIGKILL)."""
    process = subprocess.Popen(
        [sys.executable, "-c", f"import sys, time; time.sleep(60 if {code} is None else 0); sys.exit({code or 0})"]
    )
    if code is None:
        process.kill()
    process.wait()
    return Child("worker", {}, process)


def test_restarts_back_off_and_only_start_up_failures_in_a_row_give_up():
    from lightq.children import RestartPolicy

    policy, now = RestartPolicy(), time.monotonic()
    assert policy.delay(exited_child(1), now) == 0.5
    assert policy.delay(exited_child(1), now + 1) == 1.0
    assert policy.delay(exited_child(None), now + 2) == 2.0  # killed from outside: not a start-up failure
    assert policy.delay(exited_child(1), now + 3) == 4.0
    assert policy.delay(exited_child(1), now + 4) == 8.0
    assert policy.delay(exited_child(1), now + 5) is None  # the third start-up failure in a row
