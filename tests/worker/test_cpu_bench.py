"""bench/serving/cpu_bench.py's workload and thread count (the benchmark itself runs lightq serve and transformers)."""

from bench.serving.cpu_bench import FIRST_ID, lightq_threads, workload
from lightq.launcher import worker_env


def test_workload_is_seeded_and_in_range():
    work = workload()
    assert work == workload() and work != workload(seed=1)
    assert len(work.prompts) == 32 and work.new_tokens == 64 and work.output_tokens == 32 * 64
    assert all(16 <= len(p) <= 256 for p in work.prompts)
    assert len({len(p) for p in work.prompts}) > 16  # lengths spread over the range
    assert all(FIRST_ID <= i < 49152 for p in work.prompts for i in p)


def test_a_repeated_burst_shares_no_prefix_with_the_first():
    work = workload()
    assert work.fresh(0) == work
    again = work.fresh(1)
    assert [len(p) for p in again.prompts] == [len(p) for p in work.prompts] and again == work.fresh(1)
    starts = [tuple(p[:2]) for p in work.prompts + again.prompts] + [tuple(work.warm_up()[:2])]
    assert len(set(starts)) == len(starts)  # no two share even their first two ids: no cache hit
    assert all(FIRST_ID <= i < 49152 for p in again.prompts for i in p)


def test_transformers_gets_the_workers_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert lightq_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert lightq_threads() == int(worker_env({}, 1)["OMP_NUM_THREADS"]) >= 1


def test_each_side_runs_its_own_default_dtype_unless_one_is_named():
    import torch

    from bench.serving.cpu_bench import sides_dtypes
    from worker.main import pick_dtype

    ours = str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    assert sides_dtypes("default") == (ours, "float32")  # transformers loads the GGUF in fp32
    assert sides_dtypes("bfloat16") == ("bfloat16", "bfloat16")
    assert sides_dtypes("float32") == ("float32", "float32")
