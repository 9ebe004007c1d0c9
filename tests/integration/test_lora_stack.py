"""LoRA adapters through a real ``lightq serve`` (issue 32): one worker on the embedded SmolLM2 with
two adapters made by ``peft`` (--lora_modules); a completion naming each adapter answers PEFT's
greedy text, one naming none the base model's; /v1/models lists the adapters; the worker's load
record publishes them; an unknown adapter is a 404 with nothing queued."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch

from tests.integration.stack import start_stack
from tests.worker.lora_helpers import AdapterRecipe, greedy, make_adapter

pytestmark = pytest.mark.slow

RECIPES = [
    AdapterRecipe("attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=21, alpha=16.0),
    AdapterRecipe("mlp4", 4, ("gate_proj", "down_proj"), seed=22, alpha=8.0),
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_hf_dir, smollm2_tokenizer, smollm2_weights, redis_url):
    """(stack, prompt ids, PEFT's texts per adapter name or None)."""
    from transformers import AutoModelForCausalLM

    tokenizer = smollm2_tokenizer
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
    prompt = list(out["input_ids"])
    ref = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora-stack")
    tokens = {None: greedy(ref, prompt, NEW_TOKENS)}
    for recipe in RECIPES:
        tokens[recipe.name] = make_adapter(ref, recipe, str(root / recipe.name), [prompt], NEW_TOKENS)[0]
    del ref
    special = set(tokenizer.all_special_ids)
    texts = {}
    for name, ids in tokens.items():
        end = next((i for i, t in enumerate(ids) if t in special), len(ids))  # lightq stops at an end token
        texts[name] = tokenizer.decode(ids[:end])
    assert len(set(texts.values())) == len(texts)  # each adapter changes the answer
    specs = [f"{r.name}={root / r.name}" for r in RECIPES]
    extra = ["--max_total_token_num", "2048", "--max_req_total_len", "512", "--lora_modules", *specs]
    prefix = f"lightq-lora-{uuid.uuid4().hex[:8]}"
    stack = start_stack(str(root / "serve.log"), redis_url=redis_url, prefix=prefix, workers=1, extra=extra)
    try:
        yield stack, prompt, texts
    finally:
        stack.close()


def complete(stack, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    return httpx.post(f"{stack.http}/v1/completions", json=body, timeout=300)


def test_each_adapter_answers_as_peft(served):
    stack, prompt, texts = served
    models = httpx.get(f"{stack.http}/v1/models", timeout=30).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("attn8", base), ("mlp4", base)]
    (load,) = stack.live_workers().values()
    assert load.adapters == ["attn8", "mlp4"]
    for name in ["attn8", None, "mlp4"]:
        reply = complete(stack, name or base, prompt)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == texts[name], name


def test_an_unknown_adapter_is_a_404(served):
    stack, prompt, _ = served
    client = stack.client()
    before = client.xlen(stack.keys.requests())
    reply = complete(stack, "nope", prompt)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    body = {"inputs": "Hi", "parameters": {"adapter": "nope"}}
    reply = httpx.post(f"{stack.http}/generate", json=body, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "parameters.adapter"
    try:
        assert client.xlen(stack.keys.requests()) == before  # nothing queued
    finally:
        client.close()
