"""The README's client examples (and docs/api.md's, which continue them), copied out of the Markdown and
run as a user would after ``make serve``: each in a fresh ``python`` of this venv (where ``make serve``
put the ``openai`` client, issue 33 item 5) against ``lightq serve`` on the embedded SmolLM2, the
address the only change."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import MUST_HAPPEN_S

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"  # the API reference, moved out of the README (issue 33, item 12)


def blocks(heading: str, language: str, doc: Path = README) -> list[str]:
    """The ``language`` code blocks of ``doc``'s section under ``heading`` (up to the next heading)."""
    text = doc.read_text()
    start = text.index(f"\n{heading}\n")
    end = re.search(r"\n#{2,3} ", text[start + 1 :])
    section = text[start : start + 1 + end.start()] if end else text[start:]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def run(code: str, http: str) -> str:
    code = code.replace("http://127.0.0.1:8000", http).replace("127.0.0.1:8000", http.removeprefix("http://"))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=MUST_HAPPEN_S, check=False
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture
def http(smollm2_single_stack) -> str:
    return smollm2_single_stack.http


def test_run_it_examples(http):
    (python,) = blocks("## Run it", "python")
    assert run(python, http).strip()
    (curl,) = [b for b in blocks("## Run it", "bash") if b.startswith("curl ")]
    out = subprocess.run(
        curl.replace("127.0.0.1:8000", http.removeprefix("http://")),
        shell=True,
        capture_output=True,
        text=True,
        timeout=MUST_HAPPEN_S,
        check=True,
    )
    assert '"count_output_tokens": 17' in out.stdout.replace('":17', '": 17'), out.stdout


def test_openai_client_examples_then_structured_output_and_tools(http):
    """The structured-output and tool examples continue the OpenAI client's (``client``, ``model``)."""
    (client,) = blocks("### With the OpenAI client", "python")
    (structured,) = blocks("## Structured output and tool calls", "python", API)
    out = run(client + "\n" + structured, http)
    assert "'name'" in out and "'age'" in out, out  # the person, parsed
