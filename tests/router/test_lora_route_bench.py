"""bench/serving/lora_route_bench.py's arithmetic: both arms get the same Zipf workload (the most
popular adapter most often), and the goals are judged as issue 32 states them (adapter loads per
request at most half of load-only routing's, median TTFT no worse)."""

from collections import Counter

from bench.serving.lora_route_bench import Arm, compare, parse_args
from bench.workloads.lora_mix import workload


def test_the_workload_is_zipf_and_the_same_in_every_arm():
    args = parse_args(["--requests", "2000", "--adapters", "50", "--zipf-a", "1.1", "--request-rate", "10"])
    args.vocab = 512
    first, again = workload(args), workload(args)
    assert first == again
    counts = Counter(name for _, name, _ in first)
    assert counts.most_common(1)[0][0] == "a0" and counts["a0"] > 2 * counts["a1"] * 0.9 > counts["a9"]
    assert all(3 <= i < 512 for _, _, prompt in first[:20] for i in prompt)
    assert 150 < first[-1][0] < 250  # 2,000 arrivals at 10 a second


def test_the_goals_as_the_issue_states_them():
    def arm(name, loads, ttft_ms):
        return Arm(name, loads=loads, ttfts=[ttft_ms / 1000] * 100)

    lines = compare({"aware": arm("adapter-aware", 20, 30.0), "least": arm("load-only", 40, 31.0)})
    assert lines[-2].endswith("0.50: met") and lines[-1].endswith("met") and "NOT" not in lines[-1]
    lines = compare({"aware": arm("adapter-aware", 21, 32.0), "least": arm("load-only", 40, 31.0)})
    assert lines[-2].endswith("NOT met") and lines[-1].endswith("NOT met")
