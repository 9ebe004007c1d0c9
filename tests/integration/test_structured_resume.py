"""A structured request whose worker is SIGKILLed mid-generation resumes on the other worker
(``lightq serve --workers 2``, the embedded SmolLM2): its matcher is rebuilt from the tokens it had
emitted, and the final output is the uninterrupted greedy run's, token for token, and validates."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from tests.waiting import MUST_HAPPEN_S

pytestmark = pytest.mark.slow

PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 6,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}
BODY = {
    "inputs": "A list of six people with their ages, as JSON:",
    "parameters": {"max_new_tokens": 300, "guided_json": PEOPLE, "do_sample": False},
}


@pytest.fixture
def stack(smollm2_pair_stack):
    """2 workers on the embedded SmolLM2 (tests/conftest.py's ``smollm2_pair``, test_e2e.py's stack:
    the same pool sizes; its Redis the one serve starts instead of the test Redis)."""
    return smollm2_pair_stack


def valid(text: str) -> bool:
    people = json.loads(text)["people"]
    return len(people) == 6 and all(set(p) == {"name", "age"} and type(p["age"]) is int for p in people)


def test_a_killed_workers_structured_request_resumes_exactly(stack):
    whole = httpx.post(f"{stack.http}/generate", json=BODY, timeout=300).json()
    assert whole["finish_reason"] == "stop" and valid(whole["generated_text"][0]), whole
    request_id = httpx.post(f"{stack.http}/v1/requests", json=BODY, timeout=30).json()["id"]
    deadline = time.monotonic() + MUST_HAPPEN_S
    while True:  # kill its worker once some tokens are out, well before the end
        status = httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json()
        if status["status"] == "running" and status["output_tokens"] >= 8:
            break
        assert status["status"] in ("queued", "running") and time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status["output_tokens"] < whole["count_output_tokens"] - 8, "too late to kill it mid-generation"
    os.kill(int(status["worker"].rsplit("-", 1)[1]), signal.SIGKILL)
    while status["status"] in ("queued", "running"):
        assert time.monotonic() < deadline + MUST_HAPPEN_S, status
        time.sleep(0.3)
        status = httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json()
    assert status["status"] == "finished" and status["finish_reason"] == "stop", status
    assert status["output_text"] == whole["generated_text"][0]
    assert valid(status["output_text"])
