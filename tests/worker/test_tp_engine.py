"""``--tp 2`` through the real worker wiring on CPU (gloo, 2 processes): the
engine on rank 0 (this test process), a follower spawned by ``worker.runner.tp``.
Greedy tokens equal ``--tp 1``'s (and transformers') with requests joining
mid-flight, a chunked prefill beside decodes, and a cancel; followers leave
on shutdown or when rank 0 dies, and rank 0 leaves when a follower dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

from shared.config import ModelSettings
from shared.worker_settings import WorkerSettings
from tests.waiting import MUST_HAPPEN_S
from tests.worker.test_engine import reference_greedy, req, run_to_end
from tests.worker.token_rows import flat
from worker.engine.events import Token
from worker.main import build_engine, check_tp, follower, rank_device
from worker.runner import tp as tensor_parallel

POOL = 200
RUNNING_MAX = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tp")
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=256,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    ref.save_pretrained(folder)
    return ref, str(folder)


def settings(folder: str, tp: int, **kw) -> WorkerSettings:
    kw = {
        "device": "cpu",
        "max_total_token_num": POOL,
        "running_max_req_size": RUNNING_MAX,
        "batch_max_tokens": 8,
        **kw,
    }
    return WorkerSettings(model=ModelSettings(model_dir=folder, max_req_total_len=120), tp=tp, **kw)


@pytest.fixture(scope="module")
def engines(tiny):
    """(--tp 1 engine, --tp 2 engine on rank 0 of a live group): one group for the module."""
    _, folder = tiny
    tp2 = settings(folder, 2)
    group = tensor_parallel.launch(2, rank_device(tp2, 0), follower, tp2)
    try:
        yield build_engine(settings(folder, 1)), build_engine(tp2, None, group)
    except BaseException:
        group.abort()
        raise
    group.close()
    assert [p.exitcode for p in group.followers] == [0]  # left on the shutdown message


def assert_idle(engine) -> None:
    assert engine.runner.slots.available == POOL  # each slot free, or cached and evictable
    assert engine.runner.slots.num_held == 0
    assert engine.runner.table.num_free_rows == RUNNING_MAX


def test_continuous_batching_tp2_equals_tp1(tiny, engines):
    ref, _ = tiny
    prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 3], "c": list(range(20, 40))}  # c: a prefill in 3 chunks
    arrivals = lambda: {  # noqa: E731
        0: [req("a", prompts["a"], 12, ignore_eos=True)],
        3: [req("b", prompts["b"], 6, ignore_eos=True), req("c", prompts["c"], 9, ignore_eos=True)],
    }
    single, group = (run_to_end(engine, arrivals()) for engine in engines)
    assert group == single
    for rid, n in [("a", 12), ("b", 6), ("c", 9)]:
        assert group[rid] == reference_greedy(ref, prompts[rid], n), rid
    assert_idle(engines[1])


def test_chunked_prefill_beside_decode_tp2_equals_tp1(engines):
    short, long_prompt = [5, 6, 7], list(range(30, 70))  # 40 tokens: five chunks of 8

    def run(engine) -> tuple[dict, int]:
        engine.add(req("short", short, 12, ignore_eos=True))
        engine.step()
        engine.add(req("long", long_prompt, 5, ignore_eos=True))
        tokens, overlapping = {}, 0
        while engine.has_work:
            got = [e for e in flat(engine.step()) if isinstance(e, Token)]
            overlapping += "long" not in tokens and any(e.request_id == "short" for e in got)
            for e in got:
                tokens.setdefault(e.request_id, []).append(e.token_id)
        return tokens, overlapping

    (single, _), (group, overlapping) = (run(engine) for engine in engines)
    assert overlapping >= 4  # the follower ran mixed steps: short's decode beside long's chunks
    assert group == single
    assert_idle(engines[1])


def test_cancel_mid_flight_tp2_equals_tp1(engines):
    def run(engine) -> dict:
        a, b = req("a", [1, 2, 3], 50, ignore_eos=True), req("b", [4, 5, 9, 10], 8, ignore_eos=True)
        engine.add(a)
        engine.add(b)
        tokens: dict[str, list[int]] = {}
        for step in range(20):
            if step == 3:
                engine.cancel(a)  # its slots go back at once; the next steps decode b alone
            for e in flat(engine.step()):
                if isinstance(e, Token):
                    tokens.setdefault(e.request_id, []).append(e.token_id)
            if not engine.has_work:
                break
        return tokens

    single, group = (run(engine) for engine in engines)
    assert group == single and len(group["a"]) == 3 and len(group["b"]) == 8
    assert_idle(engines[1])


def test_group_forked_over_tp2_equals_transformers(tiny, engines):
    """A group's samples read the leader's prompt through table rows the fork copied on every rank."""
    from shared.schemas import GenerateRequest, SamplingParams
    from worker.engine.request import Req

    ref, _ = tiny
    prompt = list(range(30, 50))  # 20 tokens: the fork comes with the third chunk
    msg = GenerateRequest(
        id="g", prompt_ids=prompt, params=SamplingParams(max_new_tokens=10, ignore_eos=True), created_ms=0, n=3
    )
    engine = engines[1]
    engine.add(Req(msg=msg, inbox_id="g-0"))
    tokens: dict[int, list[int]] = {}
    while engine.has_work:
        for e in flat(engine.step()):
            if isinstance(e, Token):
                tokens.setdefault(e.choice, []).append(e.token_id)
    assert tokens == {c: reference_greedy(ref, prompt, 10) for c in range(3)}
    assert_idle(engine)


def test_paused_and_re_prefilled_requests_tp2_equal_transformers(tiny, engines):
    from shared.admission import AdmissionRule
    from shared.config import AdmissionSettings

    ref, _ = tiny
    engine = engines[1]
    rule, eos = engine.rule, engine.eos_ids
    # The history says outputs are short (5 tokens); these run 40: the pool (200) overflows and the
    # newest requests are paused, then prefilled again (prompt + output) over rows the followers reused.
    # (No EOS rather than ignore_eos: the estimate knows an ignore_eos request runs to its limit.)
    engine.rule = AdmissionRule(AdmissionSettings(admission="past_future", history_window=10, history_prior=5))
    engine.rule.learn([5] * 10)
    engine.eos_ids = set()
    pauses = engine.num_pauses
    try:
        prompts = {f"r{i}": [3 + i, 7, 11 + i, 13, 17] for i in range(8)}
        tokens = run_to_end(engine, {0: [req(rid, p, 40) for rid, p in prompts.items()]})
    finally:
        engine.rule, engine.eos_ids = rule, eos
    assert engine.num_pauses > pauses
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_greedy(ref, prompt, 40), rid
    assert_idle(engine)


def test_tp_must_divide_the_heads_and_find_its_gpus(tiny):
    _, folder = tiny
    with pytest.raises(ValueError, match=r"--tp 3 does not fit .*divisible by the tensor-parallel size 3"):
        check_tp(settings(folder, 3))
    with pytest.raises(ValueError, match="counting"):
        check_tp(settings("counting", 2))
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match=r"--tp 2 on cuda.* needs GPUs 0\.\.1"):
            check_tp(settings(folder, 2, device="cuda"))
    check_tp(settings(folder, 2))  # 4 heads, 2 KV heads, 128 MLP columns, 96 vocabulary rows: all split


LIFECYCLE = """
import os, sys, time
from tests.worker.test_tp_engine import settings
from worker.runner import tp
from worker.main import build_engine, follower, rank_device
s = settings(sys.argv[1], 2)
group = tp.launch(2, rank_device(s, 0), follower, s)
engine = build_engine(s, None, group)
print(group.followers[0].pid, flush=True)
time.sleep(600)
"""


def start_group(folder: str) -> tuple[subprocess.Popen, int]:
    """A rank 0 in a child process, loaded and idle; and its follower's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LIFECYCLE, folder],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        start_new_session=True,
    )
    return proc, int(proc.stdout.readline())


def gone(pid: int, timeout_s: float = MUST_HAPPEN_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.2)
    return False


def test_follower_exits_when_rank0_dies(tiny):
    proc, follower_pid = start_group(tiny[1])
    proc.kill()  # no shutdown message: the follower sees its parent gone
    proc.wait()
    assert gone(follower_pid)


def test_rank0_exits_when_a_follower_dies(tiny):
    proc, follower_pid = start_group(tiny[1])
    try:
        os.kill(follower_pid, signal.SIGKILL)
        assert proc.wait(timeout=20) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
