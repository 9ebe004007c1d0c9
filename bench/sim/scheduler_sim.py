"""Discrete-time simulator of admission policies (no GPU, no Redis).

    .venv/bin/python -m bench.sim.scheduler_sim --quick        # seconds: every workload and policy, short runs
    .venv/bin/python -m bench.sim.scheduler_sim                # the recorded run (bench/RESULTS.md)

Model: ``--workers`` workers, each with a pool of ``--pool`` KV tokens,
step in lock-step. A step prefills what was admitted (its first token) and
decodes one token for every running request; a request holds prompt +
generated tokens and frees them all when it emits its last (true) token.
A closed loop of ``--clients`` clients each sends its next request when the
previous one ends, for ``--duration_s`` simulated seconds measured after
``--warmup_s`` (the history starts from its prior either way).

Admission is FCFS through ``shared.peak.check`` with the router's policies:
past-future estimates from ``shared.history`` fed with the lengths of the
requests finished so far (the prior, the largest max_new_tokens, until
then); the oracle is the same check on exact lengths. When a worker's next
step would overflow its pool it pauses its newest requests (frees their KV,
puts them back at the queue front, recomputes them by a prefill when
readmitted). As in the paper's artifact server, a request that never
started is dropped when it has waited 8 s, inside the TTFT SLA; a paused one
is never dropped (the artifact aborts only requests waiting for their first
token, and lightq's worker keeps a paused request at the head of its queue):
it resumes, pays its recompute, and misses the SLA by its gap. As the
artifact's client does (``--re-adding-failed-reqs`` in every client script),
a client whose request failed (dropped, or finished outside the SLA) sends
the same request again; ``--fresh_after_failure`` sends the next one instead
(this simulator's behaviour before 2026-11-30).

Step time (s) = base + per-KV-token read + per-prefill-token compute, a
7B-class model on an 80 GB-class GPU (derived: 13.5 GB of weights and
0.5 MB of KV per token at ~2 TB/s, ~14 GFLOP per prefill token at ~200
TFLOP/s). Goodput counts prompt + output tokens of requests that met both
SLAs (TTFT <= 10 s, largest gap between tokens <= 1.5 s), per second.
"""

from __future__ import annotations

import argparse
import heapq
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from itertools import islice

import numpy as np

from bench.workloads.admission import NAMES, Request, cap, requests, stream, summary
from shared.admission import POLICIES as ADMISSION_POLICIES
from shared.history import Estimator, OutputLengthHistory
from shared.peak import ReqState, check

POLICIES = ("conservative", "aggressive", "past_future", "past_future_quantile", "oracle")


@dataclass(frozen=True)
class Config:
    pool: int = 120_000
    workers: int = 1
    clients: int = 48
    running_max: int = 256
    batch_max_tokens: int = 18_000
    margin: float = 0.05
    window: int = 200
    poll_s: float = 0.1  # a blocked head of line is retried at least this often (the router's poll)
    ttft_sla_s: float = 10.0
    mtpot_sla_s: float = 1.5
    drop_ttft_s: float = 8.0  # the artifact server's abort of requests never started, inside the SLA
    retry_failed: bool = True  # a failed request is sent again (the artifact client's re-adding)
    base_s: float = 0.010
    kv_s: float = 2.6e-7
    prefill_s: float = 7e-5
    seed: int = 0
    warmup_s: float = 900.0
    duration_s: float = 3600.0
    warm_history: bool = False  # start with a full window of the workload's lengths, as a long-running
    # deployment's Redis list would hold, instead of the prior


@dataclass(eq=False)
class Job:
    req: Request
    arrival: float
    arrival_step: int
    gen: int = 0  # tokens generated when the current running segment began (or when paused)
    seg_start: int | None = None  # step of the current segment's prefill; None while queued
    epoch: int = 0  # bumped on pause: invalidates its finish event
    first_token: float | None = None
    last_token: float | None = None
    max_gap: float = 0.0
    queued_steps: int | None = None
    pauses: int = 0

    def generated(self, step: int) -> int:
        """Tokens out before step ``step`` runs (one per step since the segment's prefill)."""
        return self.gen if self.seg_start is None else self.gen + step - self.seg_start

    def state(self, step: int, oracle: bool) -> ReqState:
        done = self.generated(step)
        if oracle:  # the true length, published as if ignore_eos
            return ReqState(self.req.prompt + done, done, self.req.output, 1)
        return ReqState(self.req.prompt + done, done, self.req.max_new_tokens, 0)


@dataclass
class Worker:
    running: list[Job] = field(default_factory=list)
    used: int = 0


class Simulator:
    def __init__(
        self,
        source: Iterator[Request],
        policy: str,
        cfg: Config,
        max_new_tokens: int,
        past: Iterator[Request] | None = None,
    ):
        self.cfg, self.policy = cfg, policy
        self.oracle = policy == "oracle"
        self.source = source
        self.queue: deque[Job] = deque()
        self.workers = [Worker() for _ in range(cfg.workers)]
        self.recent: deque[int] = deque((r.output for r in islice(past or (), cfg.window)), maxlen=cfg.window)
        self.history = OutputLengthHistory(cfg.window, prior=max_new_tokens)
        self.history.update(self.recent)
        self.estimator = Estimator(self.history, seed=cfg.seed)
        # the oracle: past-future's check on the true lengths, with no margin
        self.admission = (
            ADMISSION_POLICIES["past_future"](self.estimator, 0.0)
            if self.oracle
            else ADMISSION_POLICIES[policy](self.estimator, cfg.margin)
        )
        self.finish_events: list[tuple[int, int, Job, int]] = []
        self.durations: list[float] = []
        self.ends: list[float] = []
        self.done: list[Job] = []  # completed while measuring
        self.num_started = self.num_aborted = self.num_pauses = self.num_tokens = self.num_steps = 0
        self.num_events = 0
        self.peak_use = 0.0
        self.changed, self.last_try = True, -1.0

    @property
    def now(self) -> float:
        return self.ends[-1] if self.ends else 0.0

    @property
    def measuring(self) -> bool:
        return self.now >= self.cfg.warmup_s

    def run(self) -> Simulator:
        for _ in range(self.cfg.clients):
            self._submit()
        while self.now < self.cfg.warmup_s + self.cfg.duration_s:
            step = len(self.durations)
            self._drop_late()
            prefill = self._admit(step)
            self._pause_overflow(step, prefill)
            self._execute(step, prefill)
        return self

    def _submit(self, failed: Request | None = None) -> None:
        """The client's next request, or the one that just failed again (``retry_failed``)."""
        req = failed if failed is not None and self.cfg.retry_failed else next(self.source)
        self.queue.append(Job(req, self.now, len(self.durations)))
        self.changed = True

    def _drop_late(self) -> None:
        def late(job: Job) -> bool:  # never started (a paused job has had a token) and waited too long
            return job.first_token is None and self.now - job.arrival > self.cfg.drop_ttft_s

        dropped = [job for job in self.queue if late(job)]
        if dropped:
            self.queue = deque(job for job in self.queue if not late(job))
            self.num_aborted += len(dropped) * self.measuring
            for job in dropped:
                self._submit(job.req)

    def _admit(self, step: int) -> list[list[Job]]:
        admitted: list[list[Job]] = [[] for _ in self.workers]
        if not self.queue or not (self.changed or self.now - self.last_try >= self.cfg.poll_s):
            return admitted
        self.changed, self.last_try = False, self.now
        while self.queue:
            job = self.queue[0]
            target = self._choose(step, job, admitted)
            if target is None:
                break
            self.queue.popleft()
            worker = self.workers[target]
            worker.running.append(job)
            worker.used += job.req.prompt + job.gen
            job.seg_start = step
            if job.queued_steps is None:
                job.queued_steps = step - job.arrival_step
                self.num_started += self.measuring
            admitted[target].append(job)
        return admitted

    def _choose(self, step: int, job: Job, admitted: list[list[Job]]) -> int | None:
        candidate = job.state(step, self.oracle)
        best, best_ratio = None, float("inf")
        for i, worker in enumerate(self.workers):
            prefill = sum(j.req.prompt + j.gen for j in admitted[i])
            if admitted[i] and prefill + candidate.held > self.cfg.batch_max_tokens:
                continue
            states = [j.state(step, self.oracle) for j in worker.running]
            ratio = check(states, candidate, self.cfg.pool, self.cfg.running_max, self.admission)
            if ratio is not None and ratio < best_ratio:
                best, best_ratio = i, ratio
        return best

    def _pause_overflow(self, step: int, admitted: list[list[Job]]) -> None:
        """Pause newest-first until every running request's next token fits."""
        for worker, new in zip(self.workers, admitted):
            while worker.running and worker.used + len(worker.running) > self.cfg.pool:
                job = worker.running.pop()
                worker.used -= job.req.prompt + job.generated(step)
                if job in new:  # admitted this step: nothing ran yet
                    new.remove(job)
                else:
                    self._end_segment(job, step - 1)
                    self.num_pauses += self.measuring
                    job.pauses += 1
                job.gen, job.seg_start = job.generated(step), None
                job.epoch += 1
                self.queue.appendleft(job)
                self.changed = True

    def _execute(self, step: int, admitted: list[list[Job]]) -> None:
        cfg = self.cfg
        duration = max(
            cfg.base_s + cfg.kv_s * w.used + cfg.prefill_s * sum(j.req.prompt + j.gen for j in new)
            for w, new in zip(self.workers, admitted)
        )
        measuring = self.measuring
        self.durations.append(duration)
        self.ends.append(self.now + duration)
        self.num_steps += measuring
        for worker, new in zip(self.workers, admitted):
            for job in new:
                self._first_token_of_segment(job, step)
            worker.used += len(worker.running)
            if measuring:
                self.num_tokens += len(worker.running)
                self.peak_use = max(self.peak_use, worker.used / cfg.pool)
        while self.finish_events and self.finish_events[0][0] <= step:
            _, _, job, epoch = heapq.heappop(self.finish_events)
            if epoch == job.epoch:
                self._finish(job, step)

    def _first_token_of_segment(self, job: Job, step: int) -> None:
        if job.first_token is None:
            job.first_token = self.ends[step]
        else:  # resumed: the pause is one gap between tokens
            job.max_gap = max(job.max_gap, self.ends[step] - job.last_token)
        last_step = step + job.req.output - job.gen - 1
        self.num_events += 1
        heapq.heappush(self.finish_events, (last_step, self.num_events, job, job.epoch))

    def _end_segment(self, job: Job, last_step: int) -> None:
        """Close a running segment whose last token came out in ``last_step``."""
        if last_step > job.seg_start:
            job.max_gap = max(job.max_gap, max(self.durations[job.seg_start + 1 : last_step + 1]))
        job.last_token = self.ends[last_step]

    def _finish(self, job: Job, step: int) -> None:
        worker = next(w for w in self.workers if job in w.running)
        worker.running.remove(job)
        worker.used -= job.req.prompt + job.req.output
        self._end_segment(job, step)
        if self.measuring:
            self.done.append(job)
        self.recent.appendleft(job.req.output)
        self.history.update(self.recent)
        self.changed = True
        self._submit(None if self.met_sla(job) else job.req)

    def met_sla(self, job: Job) -> bool:
        return job.first_token - job.arrival <= self.cfg.ttft_sla_s and job.max_gap <= self.cfg.mtpot_sla_s


@dataclass(frozen=True)
class Result:
    goodput: float
    throughput: float
    tokens_per_step: float
    queue_mean: float
    queue_p99: float
    pauses: int
    pause_share: float
    dropped_share: float
    sla_share: float
    peak_use: float

    @classmethod
    def of(cls, sim: Simulator) -> Result:
        cfg, ended = sim.cfg, sim.done
        ok = [j for j in ended if sim.met_sla(j)]
        waits = np.array([j.queued_steps for j in ended] or [0])
        num_ended = max(len(ended) + sim.num_aborted, 1)
        return cls(
            goodput=sum(j.req.prompt + j.req.output for j in ok) / cfg.duration_s,
            throughput=sum(j.req.prompt + j.req.output for j in ended) / cfg.duration_s,
            tokens_per_step=sim.num_tokens / max(sim.num_steps, 1),
            queue_mean=float(waits.mean()),
            queue_p99=float(np.percentile(waits, 99)),
            pauses=sim.num_pauses,
            pause_share=sim.num_pauses / max(sim.num_started, 1),
            dropped_share=sim.num_aborted / num_ended,
            sla_share=len(ok) / num_ended,
            peak_use=sim.peak_use,
        )

    def line(self, workload: str, clients: int, policy: str) -> str:
        return (
            f"{workload:<11} N={clients:<3} {policy:<20} goodput {self.goodput:5.0f} tok/s  "
            f"thru {self.throughput:5.0f} tok/s  out/step {self.tokens_per_step:5.1f}  "
            f"queue steps mean {self.queue_mean:4.0f} p99 {self.queue_p99:4.0f}  "
            f"pauses {self.pauses:4d} ({self.pause_share:5.1%})  dropped {self.dropped_share:5.1%}  "
            f"sla-ok {self.sla_share:5.1%}  peak use {self.peak_use:.3f}"
        )


def simulate(workload: str, policy: str, cfg: Config, max_new_tokens: int | None = None) -> Result:
    # The history's prior is the largest max_new_tokens clients send, like the router's.
    past = stream(workload, cfg.seed + 1) if cfg.warm_history else None
    sim = Simulator(stream(workload, cfg.seed, max_new_tokens), policy, cfg, cap(workload, max_new_tokens), past)
    return Result.of(sim.run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs from a warm history: a few seconds in all")
    p.add_argument("--workloads", default=",".join(NAMES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--clients", default=None, help="comma-separated closed-loop client counts (32,64; --quick: 48)")
    p.add_argument(
        "--fresh_after_failure",
        action="store_true",
        help="a client whose request failed sends its next one, not the same again",
    )
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--pool", type=int, default=120_000)
    p.add_argument("--warmup_s", type=float, default=900.0)
    p.add_argument("--duration_s", type=float, default=3600.0)
    p.add_argument("--max_new_tokens", type=int, default=None, help="override every workload's cap")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    clients = [int(c) for c in (args.clients or ("48" if args.quick else "32,64")).split(",")]
    cfg = Config(
        pool=args.pool,
        workers=args.workers,
        seed=args.seed,
        warmup_s=args.warmup_s,
        duration_s=args.duration_s,
        retry_failed=not args.fresh_after_failure,
    )
    if args.quick:
        cfg = replace(cfg, warmup_s=60.0, duration_s=180.0, warm_history=True)
    for name in args.workloads.split(","):
        print(f"# {name}: {summary(requests(name, 2000, args.seed, args.max_new_tokens))} (2,000 draws)")
        for n in clients:
            results = {}
            for policy in args.policies.split(","):
                started = time.perf_counter()
                results[policy] = simulate(name, policy, replace(cfg, clients=n), args.max_new_tokens)
                print(results[policy].line(name, n, policy), f" [{time.perf_counter() - started:.1f}s]", flush=True)
            baseline = max((results[p].goodput for p in ("conservative", "aggressive") if p in results), default=0)
            if "past_future" in results and baseline > 0:
                print(
                    f"{name:<11} N={n:<3} past_future / best of conservative, aggressive: "
                    f"{results['past_future'].goodput / baseline:.2f}x goodput"
                )


if __name__ == "__main__":
    main()
