"""The router alone: how many admission decisions and dispatches per second it makes.

    .venv/bin/python -m bench.sim.router_bench                      # 32 workers, 4,000 requests, past_future
    .venv/bin/python -m bench.sim.router_bench --workers 8 --admission conservative

No workers run: N load records (each listing ``--running`` requests of 64
prompt + 16 output tokens) are republished every 0.2 s with ``last_inbox_id``
at the inbox's newest entry, as if each worker took in everything sent to it
and kept a steady batch. The ingress stream holds ``--requests`` requests
before the clock starts; the real ``router.loop.Router`` steps until all are
dispatched (each dispatch is the real Lua script into a real inbox). It runs
twice: with the prepared worker views (``router.admission.views.Views``, production)
and with ``choose_by_check``, every worker's check from scratch per request
(the peer, as the router decided before the views), and prints one line each.
"""

from __future__ import annotations

import argparse
import math
import time
import uuid
from collections.abc import Mapping, Sequence

import numpy as np
import redis

from router.admission.choice import least_loaded_fit
from router.loop import Router
from shared import ingress
from shared.admission import request_states
from shared.batch_view import Policy
from shared.codec import encode
from shared.config import AdmissionSettings, RedisSettings, RouterSettings
from shared.keys import Keys
from shared.peak import ReqState, check
from shared.request_log import now_ms
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_load import WorkerLoad

REPUBLISH_S = 0.2


def choose_by_check(
    loads: Mapping[str, WorkerLoad],
    reserved: Mapping[str, Sequence[ReqState]],
    request: GenerateRequest,
    policy: Policy,
) -> str | None:
    """The router's choice with ``shared.peak.check`` from scratch over every worker's record and
    reservations: the peer here, and the reference tests/router/test_worker_view.py holds the
    views to."""
    candidate = request_states(request)

    def states(worker_id: str) -> list[ReqState]:
        return [ReqState(*r) for r in loads[worker_id].requests] + list(reserved.get(worker_id, ()))

    def ratio(worker_id: str) -> float | None:
        load = loads[worker_id]
        return (
            None
            if load.draining
            else check(states(worker_id), candidate, load.max_total_tokens, load.running_max_req_size, policy)
        )

    uses = {
        worker_id: math.inf if load.draining else policy.use(states(worker_id)) / load.max_total_tokens
        for worker_id, load in loads.items()
        if load.serves(request.model)
    }
    return least_loaded_fit(uses, ratio)


def publish(client: redis.Redis, keys: Keys, args) -> None:
    pipe = client.pipeline(transaction=False)
    newest = [client.xrevrange(keys.inbox(f"w{w}"), count=1) for w in range(args.workers)]
    for w, last in enumerate(newest):
        states = [(64 + g, g, 16, 1) for g in range(args.running)]  # a steady batch, one at each length
        load = WorkerLoad(
            worker_id=f"w{w}",
            seq=int(time.monotonic() * 1000),
            ts_ms=now_ms(),
            max_total_tokens=10**7,
            used_tokens=0,
            committed_tokens=0,
            num_running=args.running,
            num_waiting=0,
            last_inbox_id=last[0][0] if last else "0-0",
            running_max_req_size=10**6,
            requests=states,
        )
        pipe.set(keys.load(f"w{w}"), encode(load), px=3000)
        pipe.zadd(keys.workers(), {f"w{w}": now_ms()})
    pipe.execute()


def run(args, full_check: bool) -> dict:
    prefix = f"router-bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(args.redis_url, decode_responses=True)
    keys = Keys(prefix)
    try:
        publish(client, keys, args)
        pipe = client.pipeline(transaction=False)
        for _ in range(args.requests):
            request = GenerateRequest(
                id=uuid.uuid4().hex,
                prompt_ids=list(range(64)),
                created_ms=now_ms(),
                params=SamplingParams(max_new_tokens=16),
            )
            ingress.add(pipe, keys, request)
        pipe.execute()
        settings = RouterSettings(
            redis=RedisSettings(url=args.redis_url, key_prefix=prefix),
            admission_rule=AdmissionSettings(admission=args.admission),
        )
        router = Router(settings, redis.Redis.from_url(args.redis_url, decode_responses=True), "bench")
        if full_check:  # the peer: every worker's full check for every request
            seen: dict[str, dict[str, WorkerLoad]] = {}
            refresh = router.views.refresh

            def remember(loads, pending, rebuild=frozenset()):  # the records the router decides on
                seen["loads"] = loads
                refresh(loads, pending, rebuild)

            router.views.refresh = remember
            router._choose = lambda request: choose_by_check(
                seen["loads"], router.reservations.pending(), request, router.rule.policy
            )
        decisions: list[float] = []
        router.on_decision = lambda request, worker, seconds: decisions.append(seconds * 1000)
        done, started = 0, time.perf_counter()
        next_publish = started + REPUBLISH_S
        while done < args.requests:
            done += router.step()
            if time.perf_counter() > next_publish:
                publish(client, keys, args)
                next_publish = time.perf_counter() + REPUBLISH_S
        seconds = time.perf_counter() - started
        return {
            "path": "full check" if full_check else "views",
            "per_s": done / seconds,
            "p50": float(np.median(decisions)),
            "p99": float(np.percentile(decisions, 99)),
        }
    finally:
        stale = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if stale:
            client.delete(*stale)
        client.close()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--running", type=int, default=64, help="requests in each worker's record")
    parser.add_argument(
        "--admission",
        default="past_future",
        choices=["conservative", "aggressive", "past_future", "past_future_quantile"],
    )
    parser.add_argument("--redis_url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args(argv)
    results = [run(args, full_check=False), run(args, full_check=True)]
    for r in results:
        print(
            f"router_bench workers={args.workers} admission={args.admission} path={r['path']}: "
            f"{r['per_s']:,.0f} dispatches/s, decision p50 {r['p50']:.3f} ms p99 {r['p99']:.3f} ms"
        )
    print(f"views / full check: {results[0]['per_s'] / results[1]['per_s']:.2f}x dispatches/s")
    return results


if __name__ == "__main__":
    main()
