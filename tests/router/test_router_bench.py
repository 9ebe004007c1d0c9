"""bench/sim/router_bench.py runs the real router to the end of its queue, both decision paths."""

from bench.sim.router_bench import main


def test_router_bench_dispatches_every_request_on_both_paths(redis_settings, capsys):
    results = main(["--workers", "3", "--requests", "60", "--running", "8", "--redis_url", redis_settings.url])
    assert [r["path"] for r in results] == ["views", "full check"]
    assert all(r["per_s"] > 0 and r["p99"] >= r["p50"] > 0 for r in results)
    assert "views / full check" in capsys.readouterr().out
