"""``lightq top --once``: one snapshot of the queue and the workers, read from Redis."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
from rich.console import Console

from lightq.top import bar, printable, run, sparkline
from shared.codec import encode
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.worker_load import WorkerLoad
from tests.router.helpers import submit


def seed(rclient, keys) -> None:
    for worker_id, used in (("gpu-a", 750), ("gpu-b", 100)):
        load = WorkerLoad(
            worker_id=worker_id,
            seq=1,
            ts_ms=now_ms(),
            max_total_tokens=1000,
            used_tokens=used,
            committed_tokens=used,
            num_running=3,
            num_waiting=1,
            requests=[],
            cached_tokens=4321 if worker_id == "gpu-a" else 0,
            preempted_requests=987 if worker_id == "gpu-b" else 0,
        )
        rclient.set(keys.load(worker_id), encode(load), ex=60)
        rclient.zadd(keys.workers(), {worker_id: now_ms()})
    ensure_group(rclient, keys.requests(), ROUTER_GROUP)
    for i in range(3):
        submit(rclient, keys, f"q{i}", prompt_len=10, max_new=20, ignore_eos=True)
    rclient.xadd(keys.dead_letters(), {"msg": "x", "reason": "test"})


def test_once_prints_queue_and_workers(rclient, keys, redis_settings):
    seed(rclient, keys)
    out = io.StringIO()
    assert (
        run(
            {"once": True, "redis_url": redis_settings.url, "redis_key_prefix": keys.prefix},
            console=Console(file=out, width=160, color_system=None),
        )
        == 0
    )
    text = out.getvalue()
    assert "queue  3 requests (lag 3, pending 0)" in text
    assert "90 tokens (prompt 30 + predicted output 60)" in text
    assert "backlog 90.0 GPU-s" in text and "dead letters 1" in text
    assert "2 live worker(s)" in text
    a = next(line for line in text.splitlines() if "gpu-a" in line)
    assert "75.0%" in a and "750 / 1000" in a and "█" * 18 in a
    assert "4321" in a  # the prefix cache's tokens
    b = next(line for line in text.splitlines() if "gpu-b" in line)
    assert "10.0%" in b and b.split("│")[-2].strip() == "987"  # its pauses for a better class, last column


def test_cli_once(rclient, keys, redis_settings):
    seed(rclient, keys)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightq.cli",
            "top",
            "--once",
            "--redis_url",
            redis_settings.url,
            "--redis_key_prefix",
            keys.prefix,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "gpu-a" in result.stdout and "queue  3 requests" in result.stdout


def test_bar_and_sparkline():
    assert bar(0.5, 10).plain == "█████░░░░░" and bar(2.0, 4).plain == "████"
    assert sparkline([0, 1, 2]) == " ▄█" and sparkline([]) == ""


def _hold(data_dir, port: int):
    """A stand-in for a running serve: its data directory's port file and lock, held."""
    import fcntl
    import os

    os.makedirs(data_dir)
    (data_dir / "redis.port").write_text(str(port))
    lock = open(data_dir / "serve.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lock


def test_top_finds_the_running_serves_redis(tmp_path, monkeypatch):
    from lightq.serve_redis import find_serve_url

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("LIGHTQ_REDIS_URL", raising=False)
    root = tmp_path / "lightq" / "redis"
    assert find_serve_url({}) is None  # nothing there: the settings' default
    stale = root / "port-8001"
    stale.mkdir(parents=True)
    (stale / "redis.port").write_text("6001")  # a serve that stopped: its lock is free
    assert find_serve_url({}) is None
    held = _hold(root / "port-8000", 6000)
    assert find_serve_url({}) == "redis://127.0.0.1:6000/0"
    assert find_serve_url({"redis_url": "redis://elsewhere:6379/0"}) == "redis://elsewhere:6379/0"
    other = _hold(root / "port-8002", 6002)
    try:
        find_serve_url({})
        raise AssertionError("two running serves must be named, not guessed between")
    except SystemExit as exc:
        assert "redis://127.0.0.1:6000/0" in str(exc) and "redis://127.0.0.1:6002/0" in str(exc)
    held.close()
    other.close()


def test_top_says_which_redis_it_reads_when_no_serve_is_found(tmp_path, monkeypatch, capsys):
    """A serve started with another cache folder is not found: top said nothing and showed the default
    Redis's empty pool as if it were serve's (a new user's report); it names what it reads."""
    import lightq.top

    read = []

    async def loop(settings, once, interval, console):  # what it would read, not read here
        read.append(settings.url)

    monkeypatch.setattr(lightq.top, "_loop", loop)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("LIGHTQ_REDIS_URL", raising=False)
    run({"once": True}, console=Console(file=io.StringIO(), width=160))
    err = capsys.readouterr().err
    assert f"no running lightq serve found under {tmp_path / 'lightq' / 'redis'}" in err
    assert f"reading {read[0]}" in err and "--redis_url" in err
    held = _hold(tmp_path / "lightq" / "redis" / "port-8000", 6000)
    run({"once": True}, console=Console(file=io.StringIO(), width=160))
    held.close()
    assert read[1] == "redis://127.0.0.1:6000/0" and capsys.readouterr().err == ""  # found: nothing to say


def test_a_negative_interval_is_refused(redis_settings):
    """It refreshed without a pause, as fast as Redis answered."""
    with pytest.raises(SystemExit, match="--interval -1: seconds, above 0"):
        run({"interval": -1.0, "once": True, "redis_url": redis_settings.url})


def test_a_tenants_control_characters_never_reach_the_terminal():
    """rich escapes markup, not a terminal's escape sequences; tenants the producer took before it
    refused them may still be in the records (red team 3)."""
    assert printable("\x1b[41mEVIL\x1b]0;pwned\x07") == "?[41mEVIL?]0;pwned?"
    assert printable("a\nb\u202ec") == "a?b?c" and printable("équipe-α") == "équipe-α"
