"""bench/serving/serve_bench.py: vLLM's metric definitions, and one run against a producer with a fake worker."""

from __future__ import annotations

import asyncio

import pytest

from bench.serving.serve_bench import main as bench_main
from bench.serving.serve_metrics import Outcome, calculate, parse_slos
from tests.producer.fake_worker import serving


def test_definitions_follow_vllm():
    a = Outcome(prompt_len=10, success=True, output_tokens=3, ttft=0.1, latency=0.5, itl=[0.1, 0.3])
    b = Outcome(prompt_len=20, success=True, output_tokens=1, ttft=0.2, latency=0.2)
    failed = Outcome(prompt_len=5, error="HTTP 500")
    r = calculate(
        [a, b, failed], duration=2.0, slos=parse_slos(["ttft:150", "tpot:250", "mtpot:200"]), percentiles=[99]
    )
    assert (r["completed"], r["failed"]) == (2, 1)
    assert r["total_input_tokens"] == 30 and r["total_output_tokens"] == 4
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0 and r["total_token_throughput"] == 17.0
    assert r["tpot_ms"]["mean"] == pytest.approx(200.0)  # (500 - 100) / 2; b has one token: no TPOT
    assert r["itl_ms"]["mean"] == pytest.approx(200.0) and r["itl_ms"]["p99"] == pytest.approx(298.0)
    assert r["ttft_ms"]["median"] == pytest.approx(150.0)
    assert r["goodput_req_s"] == 0.5  # only a meets ttft <= 150 ms and tpot <= 250 ms
    assert r["goodput_pf_tok_s"] == 0.0  # a's largest gap (300 ms) breaks mtpot <= 200 ms
    with pytest.raises(ValueError):
        parse_slos(["latency:5"])


@pytest.mark.parametrize("endpoint", ["generate_stream", "completions"])
async def test_run_against_a_producer(settings, tokenizer, worker, endpoint, capsys):
    def reply(request):
        return [f"t{i}" for i in range(request.params.max_new_tokens)], "length"

    async with worker.answering(reply) as served, serving(settings, tokenizer) as url:
        args = [
            "--base-url",
            url,
            "--num-prompts",
            "6",
            "--request-rate",
            "50",
            "--sharegpt-output-len",
            "4",
            "--endpoint",
            endpoint,
            "--goodput",
            "ttft:5000",
            "e2el:10000",
        ]
        result = await asyncio.to_thread(bench_main, args)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 24 and result["goodput_req_s"] > 0
    assert len(served) == 7  # the warm-up and six measured requests
    assert "Mean TTFT (ms)" in capsys.readouterr().out


def test_gsp_groups_share_their_system_prompt():
    from bench.workloads.prefix_workloads import gsp_requests

    requests = gsp_requests(seed=1, vocab=1000, num_groups=3, prompts_per_group=4, system_len=20, question_len=5)
    assert len(requests) == 12 and all(r[1] == 25 and r[2] == 256 for r in requests)
    systems = [tuple(r[0][:20]) for r in requests]
    assert sorted(systems.count(s) for s in set(systems)) == [4, 4, 4]
    assert len({tuple(r[0]) for r in requests}) == 12  # the questions differ
    assert any(systems[i] != systems[i - i % 4] for i in range(12))  # shuffled, not sent group by group


async def test_multiturn_resends_the_history_with_the_real_replies(settings, tokenizer, worker):
    def reply(request):
        return [f"t{i}" for i in range(request.params.max_new_tokens)], "length"

    async with worker.answering(reply) as served, serving(settings, tokenizer) as url:
        args = ["--base-url", url, "--dataset", "multiturn", "--multiturn", "2,3,10,4,2", "--request-rate", "50"]
        result = await asyncio.to_thread(bench_main, args)
    assert result["completed"] == 6 and result["failed"] == 0
    turns = [r.prompt_ids for r in served[1:]]  # after the warm-up
    by_chat: dict[int, list[list[int]]] = {}
    for ids in turns:
        by_chat.setdefault(ids[0] * 100000 + ids[1], []).append(ids)
    for chat in by_chat.values():
        assert [len(t) for t in chat] == [14, 20, 26]  # + the 2-token reply and a 4-token user turn each time
        for earlier, later in zip(chat, chat[1:], strict=False):
            assert later[: len(earlier)] == earlier and later[len(earlier) : len(earlier) + 2] == [100, 101]
