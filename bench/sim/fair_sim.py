"""Priorities and fair shares (issue 19): the real router against simulated workers, two tenants.

    .venv/bin/python -m bench.sim.fair_sim              # both figures, about 40 s
    .venv/bin/python -m bench.sim.fair_sim --quick      # shorter windows

1. Priority: tenant ``hi`` sends class 0 at ``--hi_load`` of the pool's capacity, tenant ``lo``
   class 1 at ``--overload`` minus that (open loop, Poisson). Class 0's p99 time to first token
   is compared with the same class-0 traffic alone; low-priority tokens served show that the
   low class still progresses.
2. Fairness: in one class, tenant ``flood`` keeps 10x as many requests outstanding as tenant
   ``small`` (closed loop: both always have work queued, the pool is overloaded many times).
   Jain's index over the tokens each was served (prompt + output, in the window), with the
   ordering on (equal weights) and off (both requests in one tenant: arrival order).

The workers are ``bench.sim.scale_sim``'s (a time model, heartbeats, inbox through the worker
group), stepped in a thread of this process; the router runs as in production in another
(``--poll_ms`` 5, as in scale_sim). A request's first token is the end of the first step that
ran it. Times are wall-clock on whatever machine runs it: two shared cores make the tail noisy.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import redis

from bench.sim.scale_sim import SimWorker
from router.loop import Router
from shared import ingress
from shared.config import RedisSettings, RouterSettings
from shared.keys import ROUTER_GROUP, Keys
from shared.redis import ensure_group
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, RequestMeta, RequestStatus, SamplingParams
from worker.service.heartbeat import MIN_EARLY_GAP_S


@dataclass
class Books:
    """What the bench learns about each request: who sent it, when, its first token, tokens served."""

    sent: dict[str, tuple[str, float]] = field(default_factory=dict)  # id -> (label, created s)
    first: dict[str, float] = field(default_factory=dict)
    served: list[tuple[float, str, int]] = field(default_factory=list)  # (time, label, tokens)
    finished: dict[str, int] = field(default_factory=dict)  # label -> requests finished
    lock: threading.Lock = field(default_factory=threading.Lock)


class TimedWorker(SimWorker):
    """scale_sim's worker, recording first tokens and tokens served per tenant label."""

    def __init__(self, *args, books: Books, **kwargs):
        super().__init__(*args, **kwargs)
        self.books = books
        self.poked = False

    def step(self, done) -> None:
        before = {r[0] for r in self.running}
        last_beat = self.last_beat
        super().step(done)
        # A real worker's heartbeat remembers a poke inside its early-beat gap and beats when the gap
        # ends (worker/service/heartbeat.py); scale_sim's worker drops it until the next period.
        ended = before - {r[0] for r in self.running}
        self.poked = self.poked or (self.last_beat == last_beat and bool(ended))
        now = time.time()
        with self.books.lock:
            for request_id, prompt, _, _, _ in self.running:
                label = self.books.sent[request_id][0]
                if request_id not in before:  # started this step (a finished one left running already)
                    self.books.first[request_id] = now
                    self.books.served.append((now, label, prompt))
                self.books.served.append((now, label, 1))
        for request_id in ended:  # finished this step: its last token
            self.books.served.append((now, self.books.sent[request_id][0], 1))
            self.books.finished[self.books.sent[request_id][0]] = (
                self.books.finished.get(self.books.sent[request_id][0], 0) + 1
            )


def run_workers(workers: list[TimedWorker], stop: threading.Event) -> None:
    class Done:  # scale_sim's shared counter, unused here
        value = 0

        def get_lock(self):
            return threading.Lock()

    done, next_beat = Done(), 0.0
    while not stop.is_set():
        now = time.monotonic()
        if now >= next_beat:
            for worker in workers:
                worker.beat()
            next_beat = now + 0.2
        for worker in workers:
            if worker.poked and now - worker.last_beat >= MIN_EARLY_GAP_S:
                worker.poked = False
                worker.beat()
        due = [w for w in workers if w.next_step <= now]
        for worker in due:
            worker.step(done)
        if not due:
            time.sleep(max(0.0, min(min(w.next_step for w in workers), next_beat, now + 0.005) - time.monotonic()))


class Sender:
    def __init__(self, client: redis.Redis, keys: Keys, args, books: Books):
        self.client, self.keys, self.args, self.books = client, keys, args, books
        self.params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
        self.prompt = list(range(1, args.prompt_len + 1))

    def send(self, label: str, tenant: str, priority: int) -> None:
        msg = GenerateRequest(
            id=uuid.uuid4().hex,
            prompt_ids=self.prompt,
            params=self.params,
            created_ms=now_ms(),
            priority=priority,
            tenant=tenant,
        )
        with self.books.lock:
            self.books.sent[msg.id] = (label, time.time())
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.meta(msg.id), mapping=RequestMeta.fields(status=RequestStatus.QUEUED, created_ms=now_ms()))
        pipe.expire(self.keys.meta(msg.id), 300)
        ingress.add(pipe, self.keys, msg)  # its class's stream
        pipe.execute()

    def open_loop(self, streams: list[tuple[str, str, int, float]], stop: threading.Event) -> None:
        """Poisson arrivals per (label, tenant, priority, requests/s)."""
        rng = random.Random(0)
        due = [time.monotonic() + rng.expovariate(rate) for *_, rate in streams]
        while not stop.is_set():
            i = min(range(len(streams)), key=due.__getitem__)
            stop.wait(max(0.0, due[i] - time.monotonic()))
            label, tenant, priority, rate = streams[i]
            self.send(label, tenant, priority)
            due[i] += rng.expovariate(rate)

    def closed_loop(self, outstanding: dict[str, tuple[str, int]], stop: threading.Event) -> None:
        """Keep ``n`` requests of each label unfinished (label -> (tenant, n))."""
        counts = dict.fromkeys(outstanding, 0)
        while not stop.is_set():
            for label, (tenant, n) in outstanding.items():
                for _ in range(n - (counts[label] - self.books.finished.get(label, 0))):
                    self.send(label, tenant, 0)
                    counts[label] += 1
            stop.wait(0.005)


def run(args, load) -> Books:
    """One run: the pool, the router and ``load(sender, stop)``; the books after ``warmup + window``."""
    prefix = f"lightq-fairsim-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    keys, books, stop = Keys(prefix), Books(), threading.Event()
    ensure_group(client, keys.requests(), ROUTER_GROUP)
    workers = [args.worker_class(client, keys, f"sim-{i}", args, books=books) for i in range(args.workers)]
    settings = RouterSettings(
        redis=RedisSettings(url=args.redis_url, key_prefix=prefix),
        poll_ms=args.poll_ms,
        priority_reserve_slots=args.reserve_slots,
        preempt=args.preempt,
    )
    router = Router(settings, redis.Redis.from_url(args.redis_url, decode_responses=True), "fair-sim")
    sender = Sender(redis.Redis.from_url(args.redis_url, decode_responses=True), keys, args, books)
    threads = [
        threading.Thread(target=run_workers, args=(workers, stop), daemon=True),
        threading.Thread(target=router.run, daemon=True),
        threading.Thread(target=load, args=(sender, stop), daemon=True),
    ]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup_s + args.window_s)
    stop.set()
    router.stop_event.set()
    for thread in threads:
        thread.join(timeout=10)
    for key in client.scan_iter(match=f"{prefix}:*", count=1000):
        client.delete(key)
    return books


def capacity(args) -> float:
    """Requests/s the pool finishes at full batches, by the step model."""
    step_s = (args.step_ms + args.per_req_ms * args.batch) / 1000
    return args.workers * args.batch / (args.output_len * step_s)


def ttft_p99(books: Books, label: str, start: float, end: float) -> tuple[float, int]:
    """p99 TTFT (ms) of ``label``'s requests sent in [start, end); one never started counts as waiting until end."""
    waits = [
        (books.first.get(rid, end) - sent) * 1000
        for rid, (lab, sent) in books.sent.items()
        if lab == label and start <= sent < end
    ]
    return float(np.percentile(waits, 99)) if waits else float("nan"), len(waits)


def tokens(books: Books, label: str, start: float, end: float) -> int:
    return sum(n for t, lab, n in books.served if lab == label and start <= t < end)


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else float("nan")


def window(books: Books, args) -> tuple[float, float]:
    first = min(sent for _, sent in books.sent.values())
    return first + args.warmup_s, first + args.warmup_s + args.window_s - 0.5  # the last half second may be cut short


def priority_figure(args) -> None:
    cap = capacity(args)
    hi, lo = args.hi_load * cap, (args.overload - args.hi_load) * cap
    print(f"pool capacity {cap:.0f} req/s; class 0 at {hi:.0f} req/s, class 1 at {lo:.0f} req/s ({args.overload:.1f}x)")
    rows = {}
    for name, streams in [
        ("class 0 alone", [("hi", "hi", 0, hi)]),
        ("class 0 + class 1", [("hi", "hi", 0, hi), ("lo", "lo", 1, lo)]),
    ]:
        books = run(args, lambda sender, stop, s=streams: sender.open_loop(s, stop))
        start, end = window(books, args)
        p99, n = ttft_p99(books, "hi", start, end)
        lo_tokens = tokens(books, "lo", start, end) / (end - start)
        rows[name] = p99
        print(f"  {name:<18} class-0 TTFT p99 {p99:7.1f} ms over {n} requests; class-1 tokens/s {lo_tokens:7.0f}")
    print(f"  ratio (with / without class 1): {rows['class 0 + class 1'] / rows['class 0 alone']:.2f} (goal <= 2)")


def fairness_figure(args) -> None:
    print(f"flood: 'flood' keeps {10 * args.small_outstanding}, 'small' {args.small_outstanding} requests outstanding")
    for name, tenants in [("fair shares", ("flood", "small")), ("arrival order", ("one", "one"))]:
        outstanding = {
            "flood": (tenants[0], 10 * args.small_outstanding),
            "small": (tenants[1], args.small_outstanding),
        }
        books = run(args, lambda sender, stop, o=outstanding: sender.closed_loop(o, stop))
        start, end = window(books, args)
        served = [tokens(books, label, start, end) for label in ("flood", "small")]
        print(f"  {name:<14} tokens served flood {served[0]:>7} small {served[1]:>7}  Jain's index {jain(served):.3f}")


def main(argv: list[str] | None = None, worker_class: type = TimedWorker, preempt: bool = False) -> None:
    """``bench.sim.preempt_sim`` passes workers that pause on the router's asks, and ``preempt``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--redis_url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step_ms", type=float, default=25.0)
    p.add_argument("--per_req_ms", type=float, default=0.0)
    p.add_argument("--prompt_len", type=int, default=32)
    p.add_argument("--output_len", type=int, default=16)
    p.add_argument("--overload", type=float, default=2.0, help="offered load over the pool's capacity")
    p.add_argument("--hi_load", type=float, default=0.5, help="class 0's share of the capacity")
    p.add_argument(
        "--small_outstanding",
        type=int,
        default=24,
        help="more than half the pool's slots: 'small' always has work queued",
    )
    p.add_argument("--poll_ms", type=int, default=5)
    p.add_argument("--reserve_slots", type=int, default=0, help="the router's --priority_reserve_slots")
    p.add_argument("--warmup_s", type=float, default=2.0)
    p.add_argument("--window_s", type=float, default=8.0)
    p.add_argument("--quick", action="store_true", help="3 s windows")
    p.add_argument("--only", choices=["priority", "fairness"])
    args = p.parse_args(argv)
    args.worker_class, args.preempt = worker_class, preempt
    if args.quick:
        args.warmup_s, args.window_s = 1.0, 3.0
    if args.only != "fairness":
        priority_figure(args)
    if args.only != "priority":
        fairness_figure(args)


if __name__ == "__main__":
    main()
