"""The admission simulator (bench/scheduler_sim.py), which runs router.admission.check: invariants on short runs."""

import pytest

from bench.scheduler_sim import Config, Simulator, simulate
from bench.workloads import requests, stream

SHORT = Config(clients=40, warmup_s=0.0, duration_s=120.0)


@pytest.mark.parametrize("policy", ["conservative", "oracle"])
def test_exact_bounds_never_pause_and_never_overflow(policy):
    result = simulate("dist1", policy, SHORT)
    assert result.pauses == 0 and result.peak_use <= 1.0


def test_aggressive_fills_the_pool_and_pays_with_pauses():
    result = simulate("sharegpt-o1", "aggressive", Config(clients=64, warmup_s=0.0, duration_s=300.0))
    assert result.peak_use == pytest.approx(1.0, abs=0.01) and result.pauses > 0


def test_past_future_runs_more_than_conservative_without_pausing_more_than_aggressive():
    cfg = Config(clients=48, warmup_s=60.0, duration_s=240.0)
    cons, aggr, pf = (simulate("sharegpt-o1", p, cfg) for p in ("conservative", "aggressive", "past_future"))
    assert pf.tokens_per_step > 1.5 * cons.tokens_per_step
    assert pf.pauses <= aggr.pauses


def test_every_request_holds_what_it_generated():
    sim = Simulator(stream("dist3"), "past_future", SHORT, max_new_tokens=4096)
    sim.run()
    step = len(sim.durations)
    for worker in sim.workers:
        assert worker.used == sum(j.req.prompt + j.generated(step) for j in worker.running)
        assert worker.used <= sim.cfg.pool


def test_workloads_draw_the_published_shapes():
    dist2 = requests("dist2", 500)
    assert all(3072 <= r.prompt <= 5120 and 3072 <= r.output <= 5120 == r.max_new_tokens for r in dist2)
    o1 = requests("sharegpt-o1", 4000)
    assert 1900 < sum(r.output for r in o1) / len(o1) < 2400
    assert 330 < sum(r.prompt for r in o1) / len(o1) < 430
