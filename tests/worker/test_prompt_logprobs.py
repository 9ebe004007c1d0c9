"""Prompt log-probabilities (worker.runner.prompt_logprobs) on a tiny random Llama: the logprob of
every prompt token after the first and its top alternatives equal a reference forward's (transformers),
with the prompt prefilled in several chunks beside other requests, and with the prefix cache holding
the same prompt (a scoring request takes no cached prefix)."""

from __future__ import annotations

import pytest
import torch

from shared.schemas import GenerateRequest, SamplingParams
from tests.worker.test_engine import tiny  # noqa: F401 (fixture)
from tests.worker.test_prefix_cache_engine import make_engine
from worker.engine.events import Tokens
from worker.engine.request import Req

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14]


def scoring(rid: str, k: int, n: int = 1) -> Req:
    params = SamplingParams(max_new_tokens=2, prompt_logprobs=k)
    msg = GenerateRequest(id=rid, prompt_ids=PROMPT, params=params, created_ms=0, n=n)
    return Req(msg=msg, inbox_id=f"{rid}-0")


def plain(rid: str, prompt: list[int]) -> Req:
    msg = GenerateRequest(id=rid, prompt_ids=prompt, params=SamplingParams(max_new_tokens=4), created_ms=0)
    return Req(msg=msg, inbox_id=f"{rid}-0")


def prompts_of(engine, *reqs: Req) -> dict[str, list]:
    for r in reqs:
        engine.add(r)
    found: dict[str, list] = {}
    while engine.has_work:
        for event in [e for e in engine.step() if isinstance(e, Tokens)]:
            for row, prompt in event.prompts.items():
                assert event.indexes[row] == 0 and event.request_ids[row] not in found
                found[event.request_ids[row]] = prompt
    return found


def reference(ref, k: int) -> list[tuple[float, list[tuple[int, float]]]]:
    with torch.no_grad():
        logp = torch.log_softmax(ref(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    top = logp.topk(k, dim=-1)
    return [
        (float(logp[p, PROMPT[p + 1]]), list(zip(top.indices[p].tolist(), top.values[p].tolist())))
        for p in range(len(PROMPT) - 1)
    ]


def assert_close(got, want) -> None:
    assert len(got) == len(want) == len(PROMPT) - 1
    for (lp, top), (ref_lp, ref_top) in zip(got, want):
        assert lp == pytest.approx(ref_lp, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-4)


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "prefix-cache"])
def test_prompt_logprobs_match_a_reference_forward(tiny, cache):  # noqa: F811 (fixture)
    ref, folder = tiny
    engine = make_engine(folder, cache=cache, batch_max_tokens=4)  # the prompt in chunks of at most 4
    if cache:  # the same prompt already cached: the scoring request must not start after it
        prompts_of(engine, plain("warm", PROMPT))
    found = prompts_of(
        engine, plain("other", [7, 8, 9]), scoring("s", 3), scoring("group", 3, n=3), plain("late", [40, 41])
    )
    assert set(found) == {"s", "group"}  # once per request: a group's leader carries them
    assert_close(found["s"], reference(ref, 3))
    assert_close(found["group"], reference(ref, 3))
