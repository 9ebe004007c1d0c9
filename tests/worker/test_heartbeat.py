"""The heartbeat thread on real Redis: a poke publishes the record at once, not at the period's end."""

from __future__ import annotations

import logging
import time

from shared.codec import decode
from shared.worker_load import WorkerLoad
from worker.service.heartbeat import EARLY_GAP_COST, MIN_EARLY_GAP_S, Heartbeat

PERIOD_S = 60.0  # far longer than any wait below: only a poke can cause a second beat


def record_seq(rclient, keys, worker_id: str) -> int:
    raw = rclient.get(keys.load(worker_id))
    return -1 if raw is None else decode(WorkerLoad, raw).seq


def load(seq: int) -> WorkerLoad:
    return WorkerLoad(
        worker_id="hb",
        seq=seq,
        ts_ms=0,
        max_total_tokens=100,
        used_tokens=0,
        committed_tokens=0,
        num_running=0,
        num_waiting=0,
        requests=[],
    )


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def test_a_poke_beats_now_and_stop_wakes_the_thread(rclient, keys):
    heartbeat = Heartbeat(rclient, keys, "hb", PERIOD_S, load)
    heartbeat.start()
    try:
        assert record_seq(rclient, keys, "hb") == 1
        heartbeat.poke()
        assert wait_for(lambda: record_seq(rclient, keys, "hb") == 2)
        heartbeat.poke()  # a second poke is not lost, only held to the early-beat gap
        assert wait_for(lambda: record_seq(rclient, keys, "hb") == 3)
    finally:
        heartbeat.stop()
    assert not heartbeat.thread.is_alive()  # stop did not wait out the 60 s period
    assert rclient.get(keys.load("hb")) is None


def test_the_early_beat_gap_follows_what_a_beat_costs(rclient, keys):
    """Early beats hold the model process's GIL while they build the record: a costly record is
    spaced by 20x its CPU time, a cheap one goes out after the minimum gap."""

    def costly(seq: int) -> WorkerLoad:
        burn_until = time.thread_time() + 0.02  # 20 ms of this thread's CPU, as a huge batch's record
        while time.thread_time() < burn_until:
            pass
        return load(seq)

    cheap, dear = Heartbeat(rclient, keys, "hb", PERIOD_S, load), Heartbeat(rclient, keys, "hb", PERIOD_S, costly)
    try:
        cheap.beat()
        dear.beat()
        assert MIN_EARLY_GAP_S <= cheap.early_gap_s < dear.early_gap_s
        assert dear.early_gap_s >= EARLY_GAP_COST * 0.02
        short = Heartbeat(rclient, keys, "hb", 0.1, costly)  # never longer than the period itself
        short.beat()
        assert short.early_gap_s == 0.1
    finally:
        rclient.delete(keys.load("hb"), keys.workers())


def failed_beats(caplog) -> int:
    """Beats the thread logged as failed (a Redis failure, or anything else it beat on through)."""
    return sum(r.levelno >= logging.WARNING and "heartbeat" in r.getMessage() for r in caplog.records)


def test_the_thread_beats_on_through_a_whole_cluster_restart(clean_cluster, caplog):
    """Every node of a Redis Cluster down for a second: the cluster client raises what is no RedisError
    (RedisClusterUnreachableError); the thread logs it and beats on, and its record is written again
    once the cluster is back (the thread once died of it, and its worker served on unseen by routers)."""
    from shared.config import RedisSettings
    from shared.keys import Keys
    from shared.redis import sync_client

    settings = RedisSettings(url=clean_cluster.url, key_prefix="lightq-hb-cluster")
    client, keys = sync_client(settings), Keys(settings.key_prefix)
    heartbeat = Heartbeat(client, keys, "hb", 0.1, load)
    heartbeat.start()
    try:
        # down until the thread has failed at least once: the client's own retries may outlast a fixed
        # second (a beat that retried past the restart and succeeded logged nothing, once, in a full run)
        clean_cluster.restart_all(down_s=1.0, until=lambda: failed_beats(caplog) > 0)
        assert heartbeat.thread.is_alive()
        after = heartbeat.seq
        assert wait_for(lambda: record_seq(client, keys, "hb") > after, timeout_s=60)
    finally:
        heartbeat.stop()
        client.close()
