"""bench/engine/host_step.py drives the real engine through steady decoding."""

from bench.engine.host_step import engine_with, main


def test_host_step_bench_runs_the_engine_to_steady_decoding(capsys):
    engine = engine_with(4)
    for _ in range(3):
        engine.step()
    assert len(engine.running) == 4 and all(len(r.output_ids) == 3 for r in engine.running)
    results = main(["--batches", "4", "--steps", "3"])
    assert results[4] > 0 and "host_step batch=4" in capsys.readouterr().out


def test_host_step_times_one_admission_pass_over_a_burst(capsys):
    results = main(["--burst", "20"])  # admission_pass asserts that all 20 were admitted
    assert results[20] > 0 and "host_step burst=20 admission=past_future" in capsys.readouterr().out
