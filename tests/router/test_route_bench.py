"""bench/serving/route_bench.py's arithmetic: the multi-turn workload's hit-rate bound equals what a real
radix tree that never evicts finds for the conversations, and the goals are judged as the issue
states them (hit rate within 10% of one worker's; least-loaded's median TTFT at least 1.5x)."""

import numpy as np
import pytest

from bench.serving.route_bench import Arm, compare, parse_args, workload_bound
from bench.workloads.prefix_workloads import conversations
from worker.engine.radix_cache import RadixCache
from worker.engine.token_pool import TokenPool


def one_worker_hit_rate(spec: str) -> float:
    """Every turn of every conversation through one tree, as a worker serves them: the ids it
    may match (all but the last) looked up, then prompt + reply but the reply's last id kept."""
    chats, turns, system, user, output = (int(x) for x in spec.split(","))
    pool = TokenPool(1 << 20)
    cache = RadixCache(pool)
    rng = np.random.default_rng(0)
    hit = asked = 0
    for conv in conversations(1, 4096, chats, turns, system, user, output):
        for _ in range(turns):
            prompt = conv.next_prompt()
            slots, lease = cache.match(prompt[:-1])
            hit, asked = hit + len(slots), asked + len(prompt)
            reply = rng.integers(3, 4096, size=output).tolist()
            ids = (prompt + reply)[:-1]
            cache.release(ids, np.concatenate([slots, pool.allocate(len(ids) - len(slots))]), lease)
            conv.finish_turn(prompt, reply)
    return hit / asked


def test_the_workload_bound_is_what_a_tree_that_never_evicts_finds():
    for spec in ("8,4,512,128,128", "3,6,1024,256,64", "2,1,100,10,5"):
        assert workload_bound(spec) == one_worker_hit_rate(spec)


def arm(name: str, hit: float, ttft: float) -> Arm:
    return Arm(name, hit=hit * 1000, asked=1000, workers=4, result={"ttft_ms": {"median": ttft}})


def test_goals_are_judged_against_one_worker_when_it_ran_and_the_bound_when_not():
    lines = compare({"aware": arm("cache-aware", 0.80, 40.0), "least": arm("least-loaded", 0.3, 61.0)}, 0.88)
    assert lines[-2].endswith("(the workload's bound; -9.1%): met")
    assert lines[-1].endswith("= 1.52x: met")
    lines = compare(
        {"aware": arm("cache-aware", 0.70, 40.0), "least": arm("least-loaded", 0.3, 50.0), "one": arm("one", 0.8, 30)},
        0.88,
    )
    assert "(one worker's, measured; -12.5%): NOT met" in lines[-2] and lines[-1].endswith("= 1.25x: NOT met")


def test_unknown_arms_are_refused():
    assert parse_args(["--arms", "aware,one"]).arms == "aware,one"
    with pytest.raises(SystemExit):
        parse_args(["--arms", "aware,random"])
