"""LoRA adapters through a real ``lightq serve`` (issue 32): one worker on the embedded SmolLM2 with
two adapters made by ``peft`` (--lora_modules); a completion naming each adapter answers PEFT's
greedy text, one naming none the base model's; /v1/models lists the adapters; the worker's load
record publishes them; an unknown adapter is a 404 with nothing queued. A third adapter loaded at
run time (--max_loras) answers PEFT's text too, one whose shapes do not fit is a 422 and the worker
serves on, and after an unload the adapter is a 404 again."""

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
RUN_TIME = AdapterRecipe(
    "late8", 8, ("q_proj", "o_proj", "up_proj", "down_proj"), seed=23, alpha=32.0
)  # not in --lora_modules
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
    for recipe in [*RECIPES, RUN_TIME]:
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
    # one run-time slot; the loads below are answered by the worker's record, not a clock
    extra += ["--max_loras", "1", "--max_lora_rank", "16", "--lora_wait_s", "600"]
    prefix = f"lightq-lora-{uuid.uuid4().hex[:8]}"
    stack = start_stack(str(root / "serve.log"), redis_url=redis_url, prefix=prefix, workers=1, extra=extra)
    try:
        yield stack, prompt, texts, root
    finally:
        stack.close()


def complete(stack, model: str, prompt: list[int]) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    return httpx.post(f"{stack.http}/v1/completions", json=body, timeout=300)


def test_each_adapter_answers_as_peft(served):
    stack, prompt, texts, _ = served
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
    stack, prompt, _, _ = served
    client = stack.client()
    # The stream's last id, not its length: housekeeping trims acknowledged entries meanwhile (a
    # full run once saw 3 entries before and 0 after).
    before = client.xinfo_stream(stack.keys.requests())["last-generated-id"]
    reply = complete(stack, "nope", prompt)
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"
    body = {"inputs": "Hi", "parameters": {"adapter": "nope"}}
    reply = httpx.post(f"{stack.http}/generate", json=body, timeout=30)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "parameters.adapter"
    try:
        assert client.xinfo_stream(stack.keys.requests())["last-generated-id"] == before  # nothing queued
    finally:
        client.close()


def misfit(source: str, folder: str) -> str:
    """A copy of the adapter at ``source`` whose first lora_B has rows no layer of the model has: its
    config passes the producer's checks, only the worker (with the model) can tell."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    weights = f"{folder}/adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key] = torch.zeros(3, tensors[key].shape[1])
    save_file(tensors, weights)
    return folder


def test_an_adapter_loaded_and_unloaded_at_run_time(served):
    stack, prompt, texts, root = served
    base = httpx.get(f"{stack.http}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"lora_name": RUN_TIME.name, "lora_path": str(root / RUN_TIME.name)}
    reply = httpx.post(f"{stack.http}/v1/load_lora_adapter", json=body, timeout=600)
    assert reply.status_code == 200 and reply.json()["status"] == "loaded", reply.text
    models = httpx.get(f"{stack.http}/v1/models", timeout=30).json()["data"]
    assert (RUN_TIME.name, base) in [(m["id"], m["parent"]) for m in models]
    reply = complete(stack, RUN_TIME.name, prompt)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == texts[RUN_TIME.name]

    bad = {"lora_name": "misfit", "lora_path": misfit(str(root / RUN_TIME.name), str(root / "misfit"))}
    reply = httpx.post(f"{stack.http}/v1/load_lora_adapter", json=bad, timeout=600)
    assert reply.status_code == 422 and "do not fit" in reply.json()["error"]["message"], reply.text
    assert complete(stack, "misfit", prompt).status_code == 404  # taken back
    assert complete(stack, "attn8", prompt).json()["choices"][0]["text"] == texts["attn8"]  # it serves on

    reply = httpx.post(f"{stack.http}/v1/unload_lora_adapter", json={"lora_name": RUN_TIME.name}, timeout=600)
    assert reply.status_code == 200 and reply.json()["status"] == "unloaded", reply.text
    assert complete(stack, RUN_TIME.name, prompt).status_code == 404
    (load,) = stack.live_workers().values()
    assert load.adapters == ["attn8", "mlp4"] and load.lora_failed == []
    client = stack.client()
    try:
        assert client.exists(stack.keys.lora_registry(base)) == 0  # nothing left of it in Redis
    finally:
        client.close()
