"""rq's periodic housekeeping: each sweep against real Redis, and the job's self-scheduling chain."""

from __future__ import annotations

import time

from rq.registry import ScheduledJobRegistry

from producer.batches.rq_worker import housekeeping, housekeeping_job_id, queue, schedule_housekeeping
from shared.chunk_schemas import TokenChunk
from shared.codec import entry
from shared.housekeeping import drop_stale_workers, sweep_request_records, trim_ingress
from shared.keys import ROUTER_GROUP
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import RequestMeta, RequestStatus


def test_trim_keeps_every_entry_a_consumer_group_still_needs(rclient, keys):
    stream = keys.requests()
    assert trim_ingress(rclient, keys) == 0  # no stream yet
    ids = [rclient.xadd(stream, {"msg": str(i)}) for i in range(5)]
    assert trim_ingress(rclient, keys) == 0  # no group: nobody has read anything
    ensure_group(rclient, stream, ROUTER_GROUP)
    rclient.xreadgroup(ROUTER_GROUP, "r1", {stream: ">"}, count=3)
    rclient.xack(stream, ROUTER_GROUP, ids[0], ids[1])
    assert trim_ingress(rclient, keys) == 2  # the third is pending, the last two never delivered
    assert [i for i, _ in rclient.xrange(stream)] == ids[2:]
    rclient.xack(stream, ROUTER_GROUP, ids[2])
    assert trim_ingress(rclient, keys) == 1
    assert [i for i, _ in rclient.xrange(stream)] == ids[3:]
    rclient.xreadgroup(ROUTER_GROUP, "r1", {stream: ">"})
    rclient.xack(stream, ROUTER_GROUP, *ids[3:])
    assert trim_ingress(rclient, keys) == 2 and rclient.xlen(stream) == 0
    assert trim_ingress(rclient, keys) == 0


def test_trim_takes_pending_entries_acknowledged_between_its_reads(rclient, keys, monkeypatch):
    """XINFO says entries are pending, the router acknowledges them, then XPENDING has no oldest: the
    trim raised and the whole housekeeping run was lost (a red team's soak, once in ~40 runs)."""
    stream = keys.requests()
    ids = [rclient.xadd(stream, {"msg": str(i)}) for i in range(3)]
    ensure_group(rclient, stream, ROUTER_GROUP)
    rclient.xreadgroup(ROUTER_GROUP, "r1", {stream: ">"})
    xinfo_groups = rclient.xinfo_groups

    def then_acknowledged(name):
        groups = xinfo_groups(name)
        rclient.xack(stream, ROUTER_GROUP, *ids)  # the router, between the two reads
        return groups

    monkeypatch.setattr(rclient, "xinfo_groups", then_acknowledged)
    assert trim_ingress(rclient, keys) == 3 and rclient.xlen(stream) == 0


def _chunks(rclient, keys, request_id: str, at_ms: int | None = None) -> None:
    chunk = TokenChunk(request_id=request_id, index=0, token_id=1, text="x")
    rclient.xadd(keys.chunks(request_id), entry(chunk), id=f"{at_ms}-0" if at_ms else "*")


def _meta(rclient, keys, request_id: str, status: RequestStatus) -> None:
    rclient.hset(keys.meta(request_id), mapping=RequestMeta.fields(status=status))


def test_sweep_deletes_leftovers_and_gives_ended_requests_their_ttl(rclient, keys):
    ttl_s, old_ms = 600, now_ms() - 3_600_000
    _chunks(rclient, keys, "gone", at_ms=old_ms)  # record expired long ago, chunks left behind
    rclient.set(keys.cancel("gone"), "1")
    _chunks(rclient, keys, "ended")
    _meta(rclient, keys, "ended", RequestStatus.FINISHED)  # ended, but its TTLs were never written
    _chunks(rclient, keys, "running")
    _meta(rclient, keys, "running", RequestStatus.RUNNING)
    _chunks(rclient, keys, "recent")  # no record, but written just now: leave it
    rclient.hset(keys.meta("statusless"), "worker", "w9")  # a status-less hash: an unknown request
    done = {"deleted": 0, "expired": 0}
    for _ in range(1000):  # the cursor walks the keyspace a step per run
        step = sweep_request_records(rclient, keys, ttl_s, count=1000)
        done = {k: done[k] + step[k] for k in done}
        if rclient.get(keys.housekeeping_cursor()) == "0":
            break
    assert done == {"deleted": 1, "expired": 2}
    assert 0 < rclient.ttl(keys.meta("statusless")) <= ttl_s
    assert not rclient.exists(keys.chunks("gone"), keys.cancel("gone"))
    assert 0 < rclient.ttl(keys.chunks("ended")) <= ttl_s and 0 < rclient.ttl(keys.meta("ended")) <= ttl_s
    assert rclient.ttl(keys.chunks("running")) == -1 and rclient.ttl(keys.chunks("recent")) == -1


def test_stale_workers_leave_only_when_gone_quiet_and_empty(rclient, keys):
    old, now = now_ms() - 3_600_000, now_ms()
    rclient.zadd(keys.workers(), {"dead": old, "back": old, "busy": old, "fresh": now})
    rclient.set(keys.load("back"), "{}")  # its heartbeat is back
    rclient.xadd(keys.inbox("busy"), {"msg": "a request"})  # the router's janitor must requeue it first
    rclient.xadd(keys.inbox("dead"), {"msg": "done"})
    rclient.xtrim(keys.inbox("dead"), maxlen=0)  # an empty inbox stream (with its group) is left
    assert drop_stale_workers(rclient, keys, stale_s=600) == ["dead"]
    assert set(rclient.zrange(keys.workers(), 0, -1)) == {"back", "busy", "fresh"}
    assert not rclient.exists(keys.inbox("dead")) and rclient.exists(keys.inbox("busy"))


def test_housekeeping_schedules_one_chain_of_runs(rq_settings, rq_conn, rq_names, rclient, keys):
    janitor = queue(rq_names.janitor, rq_conn)
    interval = rq_settings.housekeeping.interval_s
    now = time.time()
    assert schedule_housekeeping(janitor, rq_settings, now)
    assert not schedule_housekeeping(janitor, rq_settings, now)  # another replica starting: same slot, no copy
    rclient.zadd(keys.workers(), {"dead": now_ms() - 3_600_000})
    done = housekeeping(rq_settings.model_dump(mode="json"))
    assert done["workers_dropped"] == ["dead"] and done["batch_jobs_retried"] == 0
    scheduled = ScheduledJobRegistry(queue=janitor).get_job_ids()
    slot = int(now // interval)
    assert (
        housekeeping_job_id(keys.prefix, slot + 1) in scheduled
        or housekeeping_job_id(keys.prefix, slot + 2) in scheduled
    )  # the next run (slot boundary may pass)


async def test_the_janitor_worker_runs_housekeeping_through_rq(rq_settings, rq_conn, rq_names, rclient, keys, run_rq):
    stream = keys.requests()
    ensure_group(rclient, stream, ROUTER_GROUP)
    first = rclient.xadd(stream, {"msg": "1"})
    rclient.xreadgroup(ROUTER_GROUP, "r1", {stream: ">"})
    rclient.xack(stream, ROUTER_GROUP, first)
    janitor = queue(rq_names.janitor, rq_conn)
    assert schedule_housekeeping(janitor, rq_settings, time.time() - 5)  # due: the scheduler enqueues it
    assert await run_rq(rq_names.janitor, with_scheduler=True)
    assert rclient.xlen(stream) == 0
    assert len(ScheduledJobRegistry(queue=janitor)) == 1  # and the run scheduled the next one
