"""The prefix cache on the embedded SmolLM2: greedy tokens with the cache on equal those with it
off over a chat's two turns (the second resends the first and its answer), a group and requests
sharing the chat template's system prompt."""

from __future__ import annotations

import pytest

from tests.worker.test_engine import req, run_to_end
from tests.worker.test_engine_groups import group, run
from tests.worker.test_prefix_cache_engine import assert_idle, make_engine

pytestmark = pytest.mark.slow


def chat(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    out = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def test_a_chat_a_group_and_shared_system_prompts_match_the_cache_off(smollm2_model, smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    loaded = smollm2_model  # shared: each engine attaches its own pool
    first = [{"role": "user", "content": "What is the capital of France?"}]
    outputs = []
    for cache in (False, True):
        engine = make_engine(None, cache, pool=1200, batch_max_tokens=128, loaded=loaded)
        answer = run_to_end(engine, {0: [req("turn1", chat(tokenizer, first), 8)]})["turn1"]
        second = [*first, {"role": "assistant", "content": tokenizer.decode(answer)}]
        second.append({"role": "user", "content": "And of Italy?"})
        others = [chat(tokenizer, [{"role": "user", "content": q}]) for q in ("Name a colour.", "Say hi.")]
        tokens, _ = run(
            engine,
            req("turn2", chat(tokenizer, second), 8),
            group("g", others[0], 6, n=2),
            req("hi", others[1], 6),
        )
        outputs.append((answer, tokens))
        if cache:
            assert engine.runner.slots.num_hit > len(chat(tokenizer, first))  # turn 2 skipped turn 1
            assert_idle(engine, 1200)
    assert outputs[0] == outputs[1]
