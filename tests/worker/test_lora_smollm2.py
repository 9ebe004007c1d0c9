"""Issue 32's bar on the embedded SmolLM2: with several random adapters made by ``peft`` (different
ranks and target modules), lightq's greedy tokens in one mixed batch, where every request has a
different adapter and one has none, equal PEFT's (transformers + peft on the same weights) for each.

lightq loads the same Hugging Face folder transformers does (``smollm2_hf_dir``), fresh: installing
adapters wraps the model's layers, so the session's shared ``smollm2_model`` is left alone.
"""

from __future__ import annotations

import pytest
import torch

from shared.model_files import ModelSource
from tests.worker.lora_helpers import AdapterRecipe, greedy, make_adapter
from tests.worker.test_engine import run_to_end
from tests.worker.test_lora import lora_req
from worker.engine.engine import Engine, EngineLimits
from worker.engine.token_pool import TokenPool
from worker.lora.adapter_set import load_adapters
from worker.model.loader import attach_kv_cache, load_model
from worker.runner.model_runner import ModelRunner
from worker.runner.req_table import ReqTable

pytestmark = pytest.mark.slow

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.")
NEW_TOKENS = 16
POOL = 2048
# Scaling alpha / r of 1 or 2: every adapter changes the answers (smaller ones changed none of them).
RECIPES = [
    AdapterRecipe("attn8", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=11, alpha=16.0),
    AdapterRecipe("mlp16", 16, ("gate_proj", "up_proj", "down_proj"), seed=12, alpha=16.0),
    AdapterRecipe("qv4", 4, ("q_proj", "v_proj"), seed=13, alpha=8.0),
    AdapterRecipe(
        "all32", 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=14, alpha=32.0
    ),
]


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    template = smollm2_tokenizer.apply_chat_template
    return [list(template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for c in chats]


def test_mixed_adapters_match_peft_on_smollm2(smollm2_hf_dir, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    folders, want = {}, {}
    for recipe in RECIPES:
        folders[recipe.name] = str(tmp_path / recipe.name)
        want[recipe.name] = make_adapter(ref, recipe, folders[recipe.name], prompts, NEW_TOKENS)
    want[None] = [greedy(ref, p, NEW_TOKENS) for p in prompts]
    del ref
    assert all(want[r.name] != want[None] for r in RECIPES)  # each adapter matters

    model, config = load_model(ModelSource("hf", smollm2_hf_dir), torch.float32, "cpu")
    load_adapters([f"{n}={f}" for n, f in folders.items()], model, max_rank=64)
    kv = attach_kv_cache(model, POOL, "cpu")
    runner = ModelRunner(model, TokenPool(POOL), ReqTable(16, 256, kv.hold_slot, "cpu"), config.vocab_size, "cpu")
    engine = Engine(runner, EngineLimits(POOL, 512, 16), eos_ids=set(), rule=_rule())
    names: list[str | None] = [*folders, None]
    arrivals = {0: [lora_req(f"{n}/{i}", p, n, NEW_TOKENS) for i, p in enumerate(prompts) for n in names]}
    got = run_to_end(engine, arrivals)
    for name in names:
        assert [got[f"{name}/{i}"] for i in range(len(prompts))] == want[name], name


def _rule():
    from shared.admission import AdmissionRule
    from shared.config import AdmissionSettings

    return AdmissionRule(AdmissionSettings(admission="conservative"))
