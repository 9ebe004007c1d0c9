"""Scale test: the real router (``router.loop.Router``) against N simulated workers.

    .venv/bin/python -m bench.sim.scale_sim            # N = 1, 2, 4, 8, 16, 32; 8 s each
    .venv/bin/python -m bench.sim.scale_sim --quick    # N = 1, 4, 32; 3 s each

Workers are simulated in separate processes (``--workers_per_process``
each, no model weights): each
publishes ``WorkerLoad`` heartbeats with per-request summaries (every 0.2 s, and
at once when requests finish, at most every ``MIN_EARLY_GAP_S``, as workers with small records do), takes its
inbox through the ``worker`` group, and steps on a time model (``--step_ms``
+ ``--per_req_ms`` per running request, at most ``--batch`` running); each
step adds one token to every running request, and a request that reaches
its length ends as a worker's would (terminal chunk, status, TTLs, ack,
output-length history). A load generator (a process too) keeps the ingress stream ahead of
the pool (closed loop: outstanding requests = 3 x the pool's batch slots).
The router runs as in production, in a thread of this process; each of its
admission decisions is timed through its ``on_decision`` hook. Prints per N:
decisions p50/p99, dispatches/s, generated
tokens/s, and that throughput over N x the one-worker figure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
import uuid

import numpy as np
import redis

from router.loop import Router
from shared import ingress
from shared.codec import encode, from_entry
from shared.config import AdmissionSettings, RedisSettings, RouterSettings
from shared.keys import ROUTER_GROUP, WORKER_GROUP, Keys
from shared.redis import ensure_group
from shared.request_log import end_request, now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from shared.worker_load import WorkerLoad
from worker.service.heartbeat import MIN_EARLY_GAP_S


class SimWorker:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, args):
        self.client, self.keys, self.worker_id, self.args = client, keys, worker_id, args
        self.running: list[list] = []  # [request id, prompt tokens, generated, max_new, inbox id]
        self.last_inbox_id, self.seq, self.next_step = "0-0", 0, time.monotonic()
        self.last_beat = 0.0
        self.pool = args.batch * (args.prompt_len + args.output_len)
        ensure_group(client, keys.inbox(worker_id), WORKER_GROUP)

    def beat(self) -> None:
        self.seq, self.last_beat = self.seq + 1, time.monotonic()
        states = [(p + g, g, m, 1) for _, p, g, m, _ in self.running]
        load = WorkerLoad(
            worker_id=self.worker_id,
            seq=self.seq,
            ts_ms=now_ms(),
            max_total_tokens=self.pool,
            used_tokens=sum(s[0] for s in states),
            committed_tokens=sum(p + m for _, p, _, m, _ in self.running),
            num_running=len(states),
            num_waiting=0,
            last_inbox_id=self.last_inbox_id,
            running_max_req_size=self.args.batch,
            requests=states,
            **self.record_extras(),
        )
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.load(self.worker_id), encode(load), px=3000)
        pipe.zadd(self.keys.workers(), {self.worker_id: now_ms()})
        pipe.execute()

    def record_extras(self) -> dict:
        """More fields of the load record (``bench.sim.preempt_sim``'s workers add theirs)."""
        return {}

    def step(self, done: mp.Value) -> None:
        room = self.args.batch - len(self.running)
        if room > 0:
            reply = self.client.xreadgroup(
                WORKER_GROUP, self.worker_id, {self.keys.inbox(self.worker_id): ">"}, count=room
            )
            for entry_id, fields in reply[0][1] if reply else []:
                msg = from_entry(GenerateRequest, fields)
                self.running.append([msg.id, msg.num_prompt_tokens, 0, msg.params.max_new_tokens, entry_id])
                self.last_inbox_id = entry_id
        for req in self.running:
            req[2] += 1
        finished = [r for r in self.running if r[2] >= r[3]]
        if finished:
            self._finish(finished)
            with done.get_lock():
                done.value += sum(r[2] for r in finished)
            self.running = [r for r in self.running if r[2] < r[3]]
            if time.monotonic() - self.last_beat >= MIN_EARLY_GAP_S:  # a small batch's record: room freed, say so now
                self.beat()
        self.next_step += (self.args.step_ms + self.args.per_req_ms * len(self.running)) / 1000

    def _finish(self, finished: list[list]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for request_id, _, generated, _, inbox_id in finished:
            end_request(
                pipe,
                self.keys,
                request_id,
                status=RequestStatus.FINISHED,
                reason="length",
                num_output=generated,
                ttl_s=60,
            )
            pipe.xack(self.keys.inbox(self.worker_id), WORKER_GROUP, inbox_id)
            pipe.xdel(self.keys.inbox(self.worker_id), inbox_id)
            pipe.lpush(self.keys.output_lengths(), generated)
        pipe.ltrim(self.keys.output_lengths(), 0, 999)
        pipe.execute()


def simulate(url: str, prefix: str, worker_ids: list[int], args, done: mp.Value, stop: mp.Event) -> None:
    """Some of the workers in one loop: whoever is due steps; heartbeats every 0.2 s."""
    client = redis.Redis.from_url(url, decode_responses=True)
    keys = Keys(prefix)
    workers = [SimWorker(client, keys, f"sim-{i}", args) for i in worker_ids]
    next_beat = 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_beat:
            for worker in workers:
                worker.beat()
            next_beat = now + 0.2
        due = [w for w in workers if w.next_step <= now]
        for worker in due:
            worker.step(done)
        if not due:
            time.sleep(max(0.0, min(min(w.next_step for w in workers), next_beat) - time.monotonic()))


def feed(url: str, prefix: str, args, outstanding: int, done: mp.Value, stop: mp.Event) -> None:
    """Keep ``outstanding`` requests ahead of the finished ones (closed loop)."""
    client, keys, sent = redis.Redis.from_url(url, decode_responses=True), Keys(prefix), [0]
    prompt = list(range(1, args.prompt_len + 1))
    params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
    while not stop.is_set():
        gap = outstanding - (sent[0] - done.value // args.output_len)
        if gap <= 0:
            stop.wait(0.002)
            continue
        pipe = client.pipeline(transaction=False)
        for _ in range(min(gap, 256)):
            msg = GenerateRequest(id=uuid.uuid4().hex, prompt_ids=prompt, params=params, created_ms=now_ms())
            pipe.hset(
                keys.meta(msg.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=msg.created_ms)
            )
            pipe.expire(keys.meta(msg.id), 120)
            ingress.add(pipe, keys, msg)
        pipe.execute()
        sent[0] += min(gap, 256)


def run_one(args, num_workers: int) -> dict:
    prefix = f"lightq-scale-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    keys = Keys(prefix)
    ensure_group(client, keys.requests(), ROUTER_GROUP)
    done, stop = mp.Value("q", 0), mp.Event()
    # The simulated workers and the load generator each get processes of their own, so that on a
    # machine with cores to spare only the router is measured (one process for all 32 workers and
    # the generator in the router's process were what limited the run at 32 on a 32-core host).
    per = args.workers_per_process
    procs = [
        mp.Process(
            target=simulate,
            args=(args.redis_url, prefix, list(range(i, min(i + per, num_workers))), args, done, stop),
            daemon=True,
        )
        for i in range(0, num_workers, per)
    ]
    procs.append(
        mp.Process(
            target=feed, args=(args.redis_url, prefix, args, 3 * args.batch * num_workers, done, stop), daemon=True
        )
    )
    for proc in procs:
        proc.start()
    settings = RouterSettings(
        redis=RedisSettings(url=args.redis_url, key_prefix=prefix),
        poll_ms=5,
        read_batch=512,
        admission_rule=AdmissionSettings(admission=args.admission),
    )
    the_router = Router(settings, redis.Redis.from_url(args.redis_url, decode_responses=True), "bench-router")
    decisions: list[float] = []
    dispatched = [0]

    def timed(request, chosen, seconds):  # the router's hook: every admission decision, timed
        decisions.append(seconds)
        dispatched[0] += chosen is not None

    the_router.on_decision = timed
    router_thread = threading.Thread(target=the_router.run, daemon=True)
    router_thread.start()
    time.sleep(args.warmup_s)
    tokens0, decisions0, sent0, t0 = done.value, len(decisions), dispatched[0], time.perf_counter()
    time.sleep(args.duration_s)
    tokens1, window, elapsed = done.value, decisions[decisions0:], time.perf_counter() - t0
    num_dispatched = dispatched[0] - sent0
    stop.set()
    the_router.stop_event.set()
    router_thread.join(timeout=10)
    for proc in procs:
        proc.join(timeout=10)
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    ms = np.array(window or [0.0]) * 1000
    return {
        "workers": num_workers,
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "dispatches_s": num_dispatched / elapsed,
        "tokens_s": (tokens1 - tokens0) / elapsed,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis_url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--workers", default="1,2,4,8,16,32")
    p.add_argument("--duration_s", type=float, default=8.0)
    p.add_argument("--warmup_s", type=float, default=2.0)
    p.add_argument("--step_ms", type=float, default=50.0)
    p.add_argument("--per_req_ms", type=float, default=0.2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--output_len", type=int, default=16)
    p.add_argument("--workers_per_process", type=int, default=4, help="simulated workers per process")
    p.add_argument(
        "--admission",
        default="past_future",
        choices=["conservative", "aggressive", "past_future", "past_future_quantile"],
    )
    p.add_argument("--quick", action="store_true", help="N = 1, 4, 32 for 3 s each")
    args = p.parse_args(argv)
    if args.quick:
        args.workers, args.duration_s, args.warmup_s = "1,4,32", 3.0, 1.0
    model = args.batch / ((args.step_ms + args.per_req_ms * args.batch) / 1000)
    print(
        f"one worker, by the step model at a full batch: {model:.0f} tokens/s, {model / args.output_len:.0f} requests/s"
    )
    print(
        f"{'workers':>7} {'decision p50 ms':>16} {'p99 ms':>8} {'dispatch/s':>11} {'tokens/s':>10} {'vs N x one':>11}"
    )
    rows, one = [], None
    for n in [int(x) for x in args.workers.split(",")]:
        row = run_one(args, n)
        one = one or (row["tokens_s"] if n == 1 else model)
        row["scaling"] = row["tokens_s"] / (n * one)
        rows.append(row)
        print(
            f"{n:>7} {row['p50_ms']:>16.3f} {row['p99_ms']:>8.3f} {row['dispatches_s']:>11.0f} "
            f"{row['tokens_s']:>10.0f} {row['scaling']:>11.2f}",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
