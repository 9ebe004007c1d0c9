"""The GPU benchmarks' own parts, on a CPU: the step profiler, the offline timeline and its
JSON-schema runs, and the word-level tokenizer that lets `lightq serve` run a dummy shape."""

import json
import os

import numpy as np
import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from bench.engine import offline, step_profile
from bench.engine.shapes import SHAPES, config_dir

# bench/engine/offline.py --json-schema with a schema answers complete in a few tokens
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_word_tokenizer_covers_the_shapes_vocabulary(tmp_path):
    folder = config_dir("tiny", str(tmp_path / "tiny"), tokenizer=True)
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = SHAPES["tiny"]["vocab_size"]
    assert len(tok) == vocab
    ids = [3, 77, vocab - 1]
    text = tok.decode(ids)
    assert text == f"w3 w77 w{vocab - 1}"
    assert tok.encode(text, add_special_tokens=False) == ids
    config = json.load(open(f"{folder}/config.json"))
    assert tok.eos_token_id == config["eos_token_id"] == 2 and config["architectures"] == ["LlamaForCausalLM"]


def test_step_profile_times_steps_of_a_fully_decoding_batch(capsys):
    rows = step_profile.main(
        ["--model-shape", "tiny", "--batches", "1,4", "--context", "16", "--steps", "3", "--device", "cpu"]
    )
    assert sorted(rows) == [1, 4]
    for row in rows.values():
        assert row["wall"] > 0 and row["forward"] > 0 and row["sample"] > 0
        assert row["forward"] + row["sample"] <= row["wall"] * 1.05  # parts of the step, not more
    assert "median of 3 engine steps" in capsys.readouterr().out


def test_step_profile_runs_each_request_with_its_adapter(capsys, monkeypatch, tmp_path):
    """--lora-adapters 3 at batch 4: the deltas are computed for slots of three distinct adapters."""
    from worker.lora import delta

    seen: set[int] = set()
    real = delta.lora_delta_ref

    def spy(x, a, b, slots):
        seen.update(slots.tolist())
        return real(x, a, b, slots)

    monkeypatch.setattr(delta, "lora_delta_ref", spy)
    argv = ["--model-shape", "tiny", "--batches", "4", "--context", "8", "--steps", "2", "--device", "cpu"]
    rows = step_profile.main([*argv, "--lora-adapters", "3", "--lora-rank", "4", "--lora-dir", str(tmp_path)])
    assert sorted(rows) == [4] and rows[4]["forward"] > 0
    assert len(seen - {0}) == 3  # request i with adapter i mod 3, each in a slot of its own
    assert "3 LoRA adapters of rank 4" in capsys.readouterr().out


def test_lora_paging_counts_every_page_in_by_where_its_copy_came_from(capsys, tmp_path):
    """A small 1,000-adapter-like mix (more adapters than slots): every page-in counted once,
    some from a buffer filled ahead, and each queued request's adapter paged in only as it starts."""
    from bench.engine import lora_paging

    argv = ["--model-shape", "tiny", "--device", "cpu", "--num-requests", "12", "--lora-adapters", "12"]
    argv += ["--lora-files", "2", "--lora-resident", "4", "--lora-rank", "4", "--lora-page-batch", "2"]
    counts = lora_paging.main([*argv, "--lora-prefetch", "3", "--lora-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert counts["staged"] > 0 and f"page-ins: {counts['staged'] + counts['direct']}," in out
    assert "LoRA: 12 adapters over 2 files, at most 4 resident" in out
    # the warm-up's 8 requests and the run's 12 (at most 12 distinct adapters): no
    # adapter is paged in while its request only waits in the queue
    assert counts["staged"] + counts["direct"] <= 8 + 12


def test_offline_timeline_accounts_for_every_step(capsys):
    settings = offline.WorkerSettings(
        model=offline.ModelSettings(model_dir=f"dummy:{config_dir('tiny')}", max_req_total_len=256),
        device="cpu",
        max_total_token_num=4096,
        batch_max_tokens=32,
    )
    engine = offline.build_engine(settings)
    rng = np.random.default_rng(0)
    work = [(rng.integers(3, 500, size=n).tolist(), o) for n, o in [(40, 3), (5, 9), (70, 1)]]
    timeline: list = []
    seconds = offline.drive(engine, work, progress=False, timeline=timeline)
    assert 0 < sum(t for t, _, _ in timeline) <= seconds
    assert sum(1 for _, _, prefilling in timeline if prefilling) >= 4  # 115 prompt tokens in chunks of 32
    # the third request's one token comes from its prefill: at most two ever decode together;
    # the 9-token output needs 8 decode steps after its prefill
    assert max(d for _, d, _ in timeline) == 2 and len(timeline) >= 9
    offline.print_timeline(timeline)
    assert "with prefill" in capsys.readouterr().out


def test_floor_counts_one_decode_step_per_token_of_the_longest_output():
    from bench.engine.floor import bounds

    # two requests: prompts 10 and 20, outputs 3 and 1; 1 byte of weights, 1 byte of K/V per token
    b = bounds(
        [(10, 3), (20, 1)], weight_bytes=1.0, kv_bytes_per_token=1.0, flops_per_token=1.0, bandwidth=1.0, flops=1.0
    )
    assert b["steps"] == 3 and b["output_tokens"] == 4
    # step 0: both run, context 30, memory 31 > compute 2; steps 1 and 2: context 11 and 12
    assert b["decode_overlap_s"] == 31 + 12 + 13
    assert b["decode_sum_s"] == (31 + 2) + (12 + 1) + (13 + 1)
    assert b["prefill_s"] == 30


@pytest.mark.slow  # SmolLM2's tokenizer from the GGUF (7 s)
@pytest.mark.parametrize("schema", ["bench", "small"])
def test_offline_json_schema_runs(schema, smollm2_tokenizer, tmp_path, monkeypatch, capsys):
    """The tiny shape, its vocabulary widened to SmolLM2's tokenizer: bench/engine/offline_schema.json
    never completes, so every request runs its drawn length and its output is a prefix of an
    answer; a small schema's answers complete, end ``stop`` and validate."""
    path = os.path.join(os.path.dirname(offline.__file__), "offline_schema.json")
    if schema == "small":
        path = str(tmp_path / "small.json")
        (tmp_path / "small.json").write_text(json.dumps(SMALL))
    monkeypatch.setattr(offline, "load_tokenizer", lambda source: smollm2_tokenizer)
    args = offline.parse_args(["--model-shape", "tiny", "--device", "cpu", "--json-schema", path])
    rng = np.random.default_rng(0)
    work = [(rng.integers(3, 500, size=n).tolist(), o) for n, o in [(40, 40), (5, 48), (70, 64)]]
    tally = offline.Tally(keep_ids=True)
    offline.report("tiny json-schema", work, offline.run_lightq(args, work, tally), tally)
    out = capsys.readouterr().out
    assert "vocabulary 49,152" in out
    lengths = [len(tally.output_ids[f"r{i}"]) for i in range(len(work))]
    if schema == "bench":
        assert "ended {'length': 3}" in out
        assert lengths == [o for _, o in work] and tally.tokens == sum(lengths)
        info = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer, vocab_size=49152, stop_token_ids=[2])
        grammar = xgr.GrammarCompiler(info).compile_json_schema(open(path).read(), any_whitespace=False)
        for ids in tally.output_ids.values():
            matcher = xgr.GrammarMatcher(grammar)
            assert all(matcher.accept_token(i) for i in ids) and not matcher.is_terminated()
        return
    assert "ended {'stop': 3}" in out
    for (_, drawn), ids in zip(work, tally.output_ids.values()):
        value = json.loads(smollm2_tokenizer.decode(ids, skip_special_tokens=True))
        assert len(ids) < drawn and set(value) == {"ok", "n"} and type(value["ok"]) is bool and 0 <= value["n"] <= 99
