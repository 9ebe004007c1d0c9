"""The embedded SmolLM2 GGUF: lightq's greedy output equals transformers' token for token.

Both sides read the same GGUF through transformers' dequantisation (transformers'
side saved once a session as a Hugging Face directory, lightq's kept in the
session's dequantised-GGUF folder: tests/conftest.py), so this checks lightq's
model, pool and GGUF name/permutation handling end to end; "Paris" in the
answer checks that the weights themselves came out right.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.model_harness import PoolRunner

pytestmark = pytest.mark.slow

QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer  # loaded once a session (tests/conftest.py)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [
        list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for c in chats
    ]


@pytest.fixture(scope="module")
def reference_outputs(smollm2_hf_dir, prompts) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding to differ by)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = ref.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def test_greedy_matches_transformers(smollm2_model, tokenizer, prompts, reference_outputs):
    model, config = smollm2_model
    ours = PoolRunner(model, num_slots=512, max_requests=4, max_len=128).greedy(prompts, NEW_TOKENS)
    eos = tokenizer.eos_token_id
    for got, want in zip(ours, reference_outputs):
        # transformers stops at EOS; lightq's harness decodes all NEW_TOKENS.
        assert len(want) == NEW_TOKENS or want[-1] == eos
        assert got[: len(want)] == want, (tokenizer.decode(got), tokenizer.decode(want))
    assert "Paris" in tokenizer.decode(ours[0])
