"""End to end: ``lightq serve`` with 2 workers on the embedded SmolLM2 and an
embedded Redis (nothing answers at the URL given, so the launcher starts one).
Every request travels producer -> Redis stream -> router -> worker -> chunks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from shared.chunk_schemas import ChunkRun, TokenChunk
from shared.codec import decode
from tests.waiting import MUST_HAPPEN_S

pytestmark = pytest.mark.slow

README_BODY = {"inputs": "What is AI?", "parameters": {"max_new_tokens": 17, "frequency_penalty": 1}}


@pytest.fixture
def stack(smollm2_pair_stack):
    """2 workers on the embedded SmolLM2 behind the Redis that serve starts (tests/conftest.py's
    ``smollm2_pair``, shared with test_structured_resume.py and tests/batches/test_e2e_batch.py); its
    stop is checked after the last of them: exit code 0, and the embedded Redis gone with the pool."""
    return smollm2_pair_stack


def sse_events(response) -> list[tuple[str | None, dict]]:
    events, event_id = [], None
    for line in response.iter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            events.append((event_id, json.loads(line[5:])))
    return events


def generate(stack, body) -> dict:
    response = httpx.post(f"{stack.http}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def wait_status(stack, request_id, done, timeout_s=MUST_HAPPEN_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json()
        if done(status):
            return status
        time.sleep(0.1)
    raise AssertionError(f"request {request_id} stuck: {status}")


def submit(stack, body) -> str:
    response = httpx.post(f"{stack.http}/v1/requests", json=body, timeout=30)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_readme_curl_request_returns_smollm2_text(stack):
    out = generate(stack, README_BODY)
    assert isinstance(out["generated_text"], list) and out["generated_text"][0].strip()
    assert out["count_output_tokens"] == 17 and out["finish_reason"] == "length"
    assert out["prompt_tokens"] > 0


def test_stream_carries_the_same_tokens_as_generate(stack):
    body = {"inputs": "The capital of France is", "parameters": {"max_new_tokens": 12}}
    whole = generate(stack, body)
    with httpx.stream("POST", f"{stack.http}/generate_stream", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [e for _, e in sse_events(response)]
    assert "".join(e["token"]["text"] for e in events) == whole["generated_text"][0]
    assert [e["finished"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "Paris" in whole["generated_text"][0]
    # the stream names its request, whose status hash has every hop of its first token, in order
    status = wait_status(stack, response.headers["x-request-id"], lambda s: s["status"] == "finished")
    hops = [status[k] for k in ("created_ms", "dispatched_ms", "taken_ms", "stepped_ms", "started_ms", "finished_ms")]
    assert hops == sorted(hops) and hops[0] > 0, status


def test_submit_and_poll_matches_generate_and_replays_with_resume(stack):
    body = {"inputs": "List three colours:", "parameters": {"max_new_tokens": 10, "ignore_eos": True}}
    request_id = submit(stack, body)
    status = wait_status(stack, request_id, lambda s: s["status"] == "finished")
    assert status["output_text"] == generate(stack, body)["generated_text"][0]
    assert status["output_tokens"] == 10 and status["worker"]
    url = f"{stack.http}/v1/requests/{request_id}/stream"
    with httpx.stream("GET", url, timeout=30) as response:
        events = sse_events(response)
    assert [e["index"] for _, e in events] == list(range(10))
    with httpx.stream("GET", url, headers={"Last-Event-ID": events[3][0]}, timeout=30) as response:
        resumed = sse_events(response)
    assert [e["index"] for _, e in resumed] == list(range(4, 10))


def test_pubsub_subscriber_sees_the_tokens_the_http_client_sees(stack):
    client = stack.client()
    pubsub = client.pubsub()
    pubsub.psubscribe(stack.keys.channels())
    pubsub.get_message(timeout=1)  # the subscribe confirmation
    body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    request_id = submit(stack, body)
    status = wait_status(stack, request_id, lambda s: s["status"] == "finished")
    heard: list[TokenChunk] = []
    while (message := pubsub.get_message(timeout=2)) is not None:
        if message["type"] == "pmessage" and message["channel"] == stack.keys.channel(request_id):
            heard += decode(ChunkRun, message["data"]).tokens()  # a run of tokens a message
    pubsub.close()
    assert [c.index for c in heard] == list(range(8)) and heard[-1].finished
    assert "".join(c.text for c in heard) == status["output_text"]


def test_cancel_stops_a_running_request_and_frees_its_tokens(stack):
    body = {"inputs": "Count forever:", "parameters": {"max_new_tokens": 900, "ignore_eos": True}}
    request_id = submit(stack, body)
    wait_status(stack, request_id, lambda s: s["output_tokens"] >= 3)
    response = httpx.delete(f"{stack.http}/v1/requests/{request_id}", timeout=30)
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    final = wait_status(stack, request_id, lambda s: s["status"] == "cancelled")
    assert final["output_tokens"] < 900
    deadline = time.monotonic() + MUST_HAPPEN_S
    while any(load.used_tokens for load in stack.live_workers().values()):
        assert time.monotonic() < deadline, "KV tokens not freed after cancel"
        time.sleep(0.2)


def test_two_workers_share_twenty_requests(stack):
    body = {"inputs": "Tell me a fact about the sea.", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
    ids = [submit(stack, body) for _ in range(20)]
    finals = [wait_status(stack, i, lambda s: s["status"] == "finished") for i in ids]
    assert all(f["output_tokens"] == 8 for f in finals)
    assert len({f["worker"] for f in finals}) == 2
    assert len({f["output_text"] for f in finals}) == 1  # greedy: same text whichever worker ran it


def test_over_long_prompt_is_rejected_before_anything_is_queued(stack):
    client = stack.client()
    before = client.xinfo_stream(stack.keys.requests())["last-generated-id"]  # (housekeeping trims its length)
    response = httpx.post(
        f"{stack.http}/generate", json={"inputs": "word " * 1100, "parameters": {"max_new_tokens": 17}}, timeout=30
    )
    assert response.status_code == 400 and "1024" in response.text
    assert client.xinfo_stream(stack.keys.requests())["last-generated-id"] == before


def test_killed_worker_request_continues_on_another_with_each_index_once(stack):
    body = {"inputs": "Write a long story about a dragon.", "parameters": {"max_new_tokens": 60, "ignore_eos": True}}
    expected = generate(stack, body)["generated_text"][0]
    request_id = submit(stack, body)
    url = f"{stack.http}/v1/requests/{request_id}/stream"
    received: list[dict] = []

    def read_stream() -> None:
        with httpx.stream("GET", url, timeout=120) as response:
            received.extend(e for _, e in sse_events(response))

    reader = threading.Thread(target=read_stream)
    reader.start()
    running = wait_status(stack, request_id, lambda s: s["output_tokens"] >= 5)
    os.kill(int(running["worker"].rsplit("-", 1)[1]), signal.SIGKILL)
    final = wait_status(stack, request_id, lambda s: s["status"] == "finished")
    reader.join(timeout=120)
    assert [e["index"] for e in received] == list(range(60))
    assert final["worker"] != running["worker"]
    assert final["output_text"] == expected


def test_stop_sequence_ends_the_request_and_is_never_emitted(stack):
    body = {"inputs": "Count: one, two, three, four, five,", "parameters": {"max_new_tokens": 40, "ignore_eos": True}}
    free = generate(stack, body)["generated_text"][0]
    stop = free.strip()[:3]  # a string the model is known to produce (greedy)
    out = generate(stack, {**body, "parameters": {**body["parameters"], "stop_sequences": [stop]}})
    assert out["finish_reason"] == "stop"
    assert stop not in out["generated_text"][0]
    assert free.startswith(out["generated_text"][0])
    deadline = time.monotonic() + MUST_HAPPEN_S
    while any(load.used_tokens for load in stack.live_workers().values()):
        assert time.monotonic() < deadline, "KV tokens not freed after a stop string"
        time.sleep(0.2)
