"""End to end with tensor parallelism on CPU: ``lightq serve --tp 2`` on a tiny
random Llama (``dummy:``, the default model's tokenizer) and an embedded
Redis. One worker of two processes (gloo) answers the README request, the
group publishes one load record, and stopping the pool stops both ranks."""

from __future__ import annotations

import json
import re
import time

import httpx
import psutil
import pytest

from shared.embedded_redis import free_port
from shared.redis import answers
from tests.integration.stack import start_stack
from tests.waiting import MUST_HAPPEN_S

pytestmark = pytest.mark.slow

README_BODY = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 17, "frequency_penalty": 1}}
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}  # SmolLM2's vocabulary and ids


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert not answers(url)
    log = str(folder / "serve.log")
    stack = start_stack(
        log,
        redis_url=url,
        prefix="lightq-tp",
        workers=1,
        extra=[
            "--tp",
            "2",
            "--model_dir",
            f"dummy:{folder}",
            "--device",
            "cpu",
            "--max_total_token_num",
            "4096",
            "--max_req_total_len",
            "1024",
        ],
    )
    ranks = tp_ranks(log)
    yield stack
    assert stack.stop() == 0, open(log).read()[-3000:]
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in ranks), (
        "a tensor-parallel rank outlived the pool"
    )


def tp_ranks(log_path: str, timeout_s: float = MUST_HAPPEN_S) -> list[int]:
    """Rank 0's pid and its followers', from rank 0's start-up line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = open(log_path).read()
        match = re.search(r"tensor parallel: 2 ranks over gloo, followers pid \[(\d+)\]", text)
        if match:
            follower = psutil.Process(int(match.group(1)))
            return [follower.ppid(), follower.pid]
        time.sleep(0.2)
    raise AssertionError(f"no tensor-parallel start-up line:\n{text[-3000:]}")


def test_readme_curl_request_returns_17_tokens(stack):
    response = httpx.post(f"{stack.http}/generate", json=README_BODY, timeout=120)
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["count_output_tokens"] == 17 and out["finish_reason"] == "length"
    assert out["prompt_tokens"] > 0 and isinstance(out["generated_text"][0], str)


def test_stream_and_generate_agree(stack):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12, "ignore_eos": True}}
    whole = httpx.post(f"{stack.http}/generate", json=body, timeout=120).json()
    with httpx.stream("POST", f"{stack.http}/generate_stream", json=body, timeout=120) as response:
        events = [json.loads(line[5:]) for line in response.iter_lines() if line.startswith("data:")]
    assert len(events) == 12 and events[-1]["finished"]
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"][0]


def test_one_load_record_for_the_group(stack):
    live = stack.live_workers()
    assert len(live) == 1, live  # two processes, one worker
