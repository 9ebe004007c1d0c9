"""The admission simulator (bench/sim/scheduler_sim.py), which runs shared.peak.check: invariants on short runs."""

import pytest

from bench.sim.scheduler_sim import Config, Job, Simulator, simulate
from bench.workloads.admission import Request, requests, stream

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


def test_only_requests_never_started_are_dropped_and_a_failed_one_is_sent_again():
    sim = Simulator(stream("dist1"), "aggressive", SHORT, max_new_tokens=4096)
    sim.ends = [20.0]  # now = 20 s
    waiting, paused = (Job(r, arrival=0.0, arrival_step=0) for r in requests("dist1", 2))
    paused.first_token = paused.last_token = 1.0  # paused 19 s ago: it waits for its turn, as in the worker
    sim.queue.extend([paused, waiting])
    sim._drop_late()
    assert [j.req for j in sim.queue] == [paused.req, waiting.req]  # waiting was dropped and sent again
    assert sim.queue[0] is paused and sim.queue[1] is not waiting and sim.queue[1].arrival == 20.0


def test_a_fresh_request_follows_a_failure_when_asked():
    cfg = Config(clients=1, warmup_s=0.0, duration_s=1.0, retry_failed=False)
    sim = Simulator(stream("dist1"), "aggressive", cfg, max_new_tokens=4096)
    sim.ends = [20.0]
    failed = Request(prompt=10, output=10, max_new_tokens=4096)  # not a draw of the stream
    sim.queue.append(Job(failed, arrival=0.0, arrival_step=0))
    sim._drop_late()
    assert len(sim.queue) == 1 and sim.queue[0].req != failed
