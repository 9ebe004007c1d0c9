"""LoRA adapters made by the ``peft`` library on a transformers model, and PEFT's greedy tokens.

Each adapter is random (``init_lora_weights=False``: B is not zero, so the adapter changes the
output) and saved in PEFT's own format, the folder ``--lora_modules`` reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterRecipe:
    name: str
    rank: int
    targets: tuple[str, ...]
    seed: int
    alpha: float = 8.0
    rslora: bool = False


def make_adapter(base, recipe: AdapterRecipe, folder: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Save ``recipe``'s adapter on ``base`` (a transformers model, left untouched) into ``folder``
    and return PEFT's greedy continuations of ``prompts``, one prompt at a time."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(recipe.seed)
    config = LoraConfig(
        r=recipe.rank,
        lora_alpha=recipe.alpha,
        target_modules=list(recipe.targets),
        init_lora_weights=False,
        lora_dropout=0.0,
        use_rslora=recipe.rslora,
    )
    model = get_peft_model(copy.deepcopy(base), config).eval()
    model.save_pretrained(folder)
    return [greedy(model, ids, max_new) for ids in prompts]


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
