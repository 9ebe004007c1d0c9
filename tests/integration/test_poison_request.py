"""A request that kills every worker it reaches must not take the pool down (issue 34, item 1).

``lightq serve`` with 2 workers on the counting model (every output known in advance), the default
``--max_attempts`` 3 (as many deaths in a row as serve once took for start-up failures) and the
stand-in's fault injection: a prompt holding ``EXIT_TOKEN`` ends the worker process at once
(``os._exit``: no clean-up, the router's janitor hands its inbox back and blames the death on the
worker's last admission), one holding ``RAISE_TOKEN`` makes the forward raise (the worker blames the
step that raised, hands its inbox back and exits). The poison request
goes in next to ordinary traffic: it ends ``failed`` in the dead-letter stream after ``--max_attempts``,
serve stays up (the deaths came after the workers were ready: not start-up failures), and every
ordinary request finishes with exactly its expected tokens."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
import redis

from lightq.dead_letters import list_dead
from tests.integration.stack import start_stack
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 3  # the default: as many deaths in a row as ended serve before (children.FAILURES)
EXIT_TOKEN, RAISE_TOKEN = 49001, 49000  # above the stand-in's vocabulary: no output counts up to them
NEW_TOKENS = 40
WAIT_S = 300  # a bound on waiting for something that must happen, not a measurement


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_url):
    log = str(tmp_path_factory.mktemp("poison") / "serve.log")
    extra = ["--model_dir", "counting", "--max_total_token_num", "20000", "--max_req_total_len", "256"]
    extra += ["--max_attempts", str(MAX_ATTEMPTS), "--liveness_ttl_s", "1.5", "--drain_timeout", "0.5"]
    extra += ["--counting_exit_token", str(EXIT_TOKEN), "--counting_raise_token", str(RAISE_TOKEN)]
    prefix = f"lightq-poison-{uuid.uuid4().hex[:8]}"
    stack = start_stack(log, redis_url=redis_url, prefix=prefix, workers=2, extra=extra)
    try:
        yield stack
    finally:
        stack.close()


@dataclass
class Streamed:
    request_id: str
    tokens: list[int]
    error: str | None = None


async def stream_one(client: httpx.AsyncClient, http: str, prompt: list[int]) -> Streamed:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    async with client.stream("POST", f"{http}/generate_stream", json=body) as response:
        assert response.status_code == 200, await response.aread()
        out = Streamed(response.headers["X-Request-Id"], [])
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                if event["token"]["id"] is not None:
                    out.tokens.append(event["token"]["id"])
                out.error = out.error or event.get("error")
    return out


async def until_ended(client: httpx.AsyncClient, http: str, request_id: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        view = (await client.get(f"{http}/v1/requests/{request_id}")).json()
        if view["status"] in ("finished", "failed", "cancelled", "expired"):
            return view
        await asyncio.sleep(0.2)
    raise AssertionError(f"{request_id} did not end in {WAIT_S} s")


async def poison_among(http: str, poison: list[int], prompts: list[list[int]]) -> tuple[dict, list[Streamed]]:
    """Submit the poison request (with the penalty of the red team's request), then stream the ordinary
    ones beside it; the poison's final view and the streams."""
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        body = {"inputs": poison, "parameters": {"max_new_tokens": 3, "repetition_penalty": 1.5}}
        accepted = await client.post(f"{http}/v1/requests", json=body)
        assert accepted.status_code == 202, accepted.text
        streams = [stream_one(client, http, prompt) for prompt in prompts]
        view, *outputs = await asyncio.gather(until_ended(client, http, accepted.json()["id"]), *streams)
        return view, outputs


@pytest.mark.parametrize("token", [EXIT_TOKEN, RAISE_TOKEN], ids=["exit", "raise"])
def test_a_poison_request_is_dead_lettered_and_the_pool_serves_on(stack, token):
    stack.wait_whole(2)  # a whole pool: the other case's replacements are up
    log_from = len(open(stack.log_path).read())
    prompts = [[100 + i, 2000 + i] for i in range(16)]
    view, outputs = asyncio.run(poison_among(stack.http, [5, token], prompts))

    reason = f"dead-lettered: its worker died on each of {MAX_ATTEMPTS} attempts"
    assert view["status"] == "failed" and reason in view["error"], view
    client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    try:
        letters = {letter.request.id: letter for _, letter in list_dead(client, stack.keys) if letter.request}
    finally:
        client.close()
    assert letters[view["id"]].request.prompt_ids == [5, token]
    assert stack.process.poll() is None  # serve is up
    assert httpx.get(f"{stack.http}/health", timeout=10).status_code == 200
    log = open(stack.log_path).read()[log_from:]
    assert "died while serving" in log and "failed at start-up" not in log, log[-3000:]
    stack.wait_whole(2)  # and whole again: serve started a worker for each that died

    # Every ordinary request finished with exactly its tokens: a death is blamed on the step that
    # died (a raise) or on the dead worker's last admission (an exit), and a blamed request
    # prefills alone from then on, so the poison's later deaths are its own (shared.requeue).
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.error is None, (prompt, out)
        assert out.tokens == expected_tokens(prompt[-1], NEW_TOKENS, COUNTING_VOCAB), prompt
