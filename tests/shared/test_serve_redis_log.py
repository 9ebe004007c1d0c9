"""serve's embedded Redis rewrites an append-only log that holds far more than the data, at start."""

from __future__ import annotations

import time

import redis

from lightq import serve_redis
from shared.embedded_redis import start_embedded_redis
from tests.waiting import MUST_HAPPEN_S


def test_a_log_far_past_its_data_is_rewritten_at_start(tmp_path, monkeypatch):
    """Redis's own rule measures from the log's size at start: a serve writing less than the file
    held never rewrote it, and every restart replayed more (a red team's soak: 2 to 94 MB)."""
    monkeypatch.setattr(serve_redis, "LOG_COMPACT_MIN_BYTES", 1 << 20)
    server = start_embedded_redis(appendonly=True, workdir=str(tmp_path), appendfsync="everysec")
    try:
        client = redis.Redis.from_url(server.url)
        assert not serve_redis.compact_log(server.url)  # a small log is left alone
        for i in range(8):
            client.set(f"k{i}", b"x" * (1 << 20))
        client.delete(*[f"k{i}" for i in range(8)])  # 8 MB of log, no data
        before = int(client.info("persistence")["aof_current_size"])
        assert before > 8 << 20
        assert serve_redis.compact_log(server.url)
        deadline = time.monotonic() + MUST_HAPPEN_S
        while (
            client.info("persistence")["aof_rewrite_in_progress"] or client.info("persistence")["aof_rewrite_scheduled"]
        ):
            assert time.monotonic() < deadline, "the rewrite never ended"
            time.sleep(0.05)
        assert int(client.info("persistence")["aof_current_size"]) < 1 << 20
        assert not serve_redis.compact_log(server.url)
        client.close()
    finally:
        server.stop()
