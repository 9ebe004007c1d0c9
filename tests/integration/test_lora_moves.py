"""A request with a LoRA adapter loaded at run time finishes with that adapter when the adapter is
unloaded while it runs and its worker then dies (issue 32, red team 7 finding 3): ``lightq serve
--workers 2`` on the embedded SmolLM2 with a run-time slot each (--max_loras 1) and an adapter made
by ``peft``. The request starts on one worker, the adapter is unloaded (its worker keeps it while
the request runs), the worker is SIGKILLed; the request moves to the other worker, which no longer
serves the adapter, and ends with the uninterrupted greedy run's text, token for token, instead of
``model_not_found``. A new request for the adapter is still a 404, and the worker that took the
moved request never lists the adapter for new ones and forgets it when the request ends."""

from __future__ import annotations

import os
import signal
import time
import uuid

import httpx
import pytest
import torch

from tests.integration.stack import start_stack
from tests.waiting import MUST_HAPPEN_S
from tests.worker.lora_helpers import AdapterRecipe, make_adapter

pytestmark = pytest.mark.slow

RECIPE = AdapterRecipe("late8", 8, ("q_proj", "o_proj", "up_proj", "down_proj"), seed=23, alpha=32.0)
NEW_TOKENS = 200  # long enough to outlast the unload and the kill with many tokens to go
PROMPT = "Write a long story about a lighthouse keeper and the sea:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_hf_dir, smollm2_weights, redis_url):
    """2 workers, each with one run-time adapter slot; the adapter's folder beside the serve log."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-moves")
    make_adapter(ref, RECIPE, str(root / RECIPE.name), [], 1)  # the folder only: the reference is the stack's own run
    del ref
    extra = ["--max_total_token_num", "2048", "--max_req_total_len", "512"]
    extra += ["--max_loras", "1", "--max_lora_rank", "16", "--lora_wait_s", "600"]
    prefix = f"lightq-lora-moves-{uuid.uuid4().hex[:8]}"
    served = start_stack(str(root / "serve.log"), redis_url=redis_url, prefix=prefix, workers=2, extra=extra)
    try:
        yield served, str(root / RECIPE.name)
    finally:
        served.close()


def body(adapter: str | None) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "ignore_eos": True}
    return {"inputs": PROMPT, "parameters": {**params, **({"adapter": adapter} if adapter else {})}}


def status_of(stack, request_id: str) -> dict:
    return httpx.get(f"{stack.http}/v1/requests/{request_id}", timeout=10).json()


def until_ended(stack, request_id: str) -> dict:
    deadline = time.monotonic() + 2 * MUST_HAPPEN_S
    status = status_of(stack, request_id)
    while status["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, status
        time.sleep(0.3)
        status = status_of(stack, request_id)
    return status


def test_a_started_request_finishes_with_its_unloaded_adapter_on_another_worker(stack):
    stack, folder = stack
    load = {"lora_name": RECIPE.name, "lora_path": folder}
    reply = httpx.post(f"{stack.http}/v1/load_lora_adapter", json=load, timeout=600)
    assert reply.status_code == 200, reply.text
    deadline = time.monotonic() + MUST_HAPPEN_S
    while not all(RECIPE.name in w.adapters for w in stack.live_workers().values()):  # both, for the whole run
        assert time.monotonic() < deadline, stack.live_workers()
        time.sleep(0.1)
    whole = httpx.post(f"{stack.http}/generate", json=body(RECIPE.name), timeout=300).json()
    base = httpx.post(f"{stack.http}/generate", json=body(None), timeout=300).json()
    assert whole["count_output_tokens"] == NEW_TOKENS and whole["generated_text"] != base["generated_text"]

    request_id = httpx.post(f"{stack.http}/v1/requests", json=body(RECIPE.name), timeout=30).json()["id"]
    status = status_of(stack, request_id)
    while not (status["status"] == "running" and status["output_tokens"] >= 8):
        assert status["status"] in ("queued", "running") and time.monotonic() < deadline + MUST_HAPPEN_S, status
        time.sleep(0.05)
        status = status_of(stack, request_id)
    reply = httpx.post(f"{stack.http}/v1/unload_lora_adapter", json={"lora_name": RECIPE.name}, timeout=600)
    assert reply.status_code == 200 and reply.json()["status"] == "unloaded", reply.text
    new = httpx.post(f"{stack.http}/generate", json=body(RECIPE.name), timeout=30)
    assert new.status_code == 404 and new.json()["error"]["code"] == "model_not_found", new.text

    status = status_of(stack, request_id)
    assert status["status"] == "running" and status["output_tokens"] < NEW_TOKENS - 16, "too late to move it"
    first = status["worker"]
    os.kill(int(first.rsplit("-", 1)[1]), signal.SIGKILL)
    status = until_ended(stack, request_id)
    assert status["status"] == "finished" and status["error"] is None, status
    assert status["worker"] != first and status["output_tokens"] == NEW_TOKENS
    assert status["output_text"] == whole["generated_text"][0]  # the adapter's tokens, none twice or lost

    # the worker that took it never offered the adapter to new requests, and lets it go now it ended
    deadline = time.monotonic() + MUST_HAPPEN_S
    while any(RECIPE.name in w.resident_adapters for w in stack.live_workers().values()):
        assert time.monotonic() < deadline, stack.live_workers()
        time.sleep(0.1)
    assert all(RECIPE.name not in w.adapters for w in stack.live_workers().values())
    assert httpx.post(f"{stack.http}/generate", json=body(RECIPE.name), timeout=30).status_code == 404
