"""End to end: ``lightq serve`` (embedded Redis, one worker on SmolLM2, the rq worker it
starts) and ``lightq batch submit --wait`` run as a separate process, with 3 tiny requests."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from tests.batches.helpers import chat_line, completion_line, generate_line, jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def stack(smollm2_pair_stack):
    """The embedded SmolLM2 behind the Redis that serve starts, with the rq worker serve starts
    (tests/conftest.py's ``smollm2_pair``, shared with tests/integration/test_e2e.py: 2 workers where
    this test had one; the 3 requests run on either)."""
    return smollm2_pair_stack


def test_lightq_batch_submit_wait_through_lightq_serve(stack, tmp_path):
    batch_file, out_file = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    batch_file.write_text(
        jsonl(
            completion_line("cmpl", "The capital of France is"),
            chat_line("chat", "Say hello."),
            generate_line("gen", "What is AI?"),
        )
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightq.cli",
            "batch",
            "submit",
            str(batch_file),
            "--wait",
            "--url",
            stack.http,
            "--output",
            str(out_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr + open(stack.log_path).read()[-3000:]
    batch_id = done.stdout.strip()
    out = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [line["custom_id"] for line in out] == ["cmpl", "chat", "gen"]
    assert all(line["response"]["status_code"] == 200 and line["error"] is None for line in out)
    cmpl, chat, gen = (line["response"]["body"] for line in out)
    # OpenAI's default temperature (1) samples: the answer may end (EOS) before max_tokens.
    used, reason = cmpl["usage"]["completion_tokens"], cmpl["choices"][0]["finish_reason"]
    assert cmpl["choices"][0]["text"] and (used, reason) in [(4, "length")] + [(n, "stop") for n in range(1, 5)]
    assert chat["choices"][0]["message"]["content"]
    assert gen["generated_text"][0] and gen["count_output_tokens"] == 4
    view = httpx.get(f"{stack.http}/v1/batches/{batch_id}", timeout=10).json()
    assert view["status"] == "completed" and view["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
