"""Token ids the model's logits have no column for (issue 34): the producer accepts any id of the
tokenizer's vocabulary, and the counting stand-in's logits have 4,096 columns against its tokenizer's
49,152. Penalties and min_new_tokens ignore such ids (the model can never produce them: nothing to
penalise); before, ``TokenCounts.start`` indexed its [rows, vocab] counts with them and the IndexError
killed the worker."""

from __future__ import annotations

import math

import pytest
import torch

from shared.config import ModelSettings
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from tests.worker.test_penalties import EOS, reference
from tests.worker.token_rows import flat
from worker.engine.events import Ended, Token, Tokens
from worker.engine.request import Req
from worker.main import build_engine
from worker.model.counting_model import COUNTING_VOCAB, expected_tokens
from worker.runner.penalties import PenaltyBatch, TokenCounts
from worker.runner.sampler import FLOOR_LOGPROB

V = 40
CPU = torch.device("cpu")


def test_ids_outside_the_vocabulary_are_not_counted_and_the_rest_are():
    counts = TokenCounts(max_rows=4, vocab_size=V, eos_ids={EOS, V + 3}, device=CPU)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4, min_new_tokens=3)]
    prompt, output = [1, V, 7, V + 100, 7, -1], [9, V + 1, 9]  # -1: never sent, but still no crash
    counts.start(2, prompt, output)
    logits = torch.randn(1, V) * 3
    got = counts.apply(logits, PenaltyBatch.build(params, torch.tensor([2]), [2], CPU))
    inside = [t for t in prompt if 0 <= t < V], [t for t in output if 0 <= t < V]
    expected = reference(logits[0].tolist(), *inside, params[0])
    expected[EOS] = -math.inf  # 2 tokens out of min_new_tokens 3 (the reference counts the 2 inside)
    assert torch.allclose(got[0], torch.tensor(expected), atol=1e-5)


def counting_engine():
    settings = WorkerSettings(model=ModelSettings(model_dir="counting"), device="cpu", max_total_token_num=256)
    return build_engine(settings, tokenizer=None)


def run(engine, prompt: list[int], **params) -> tuple[list[int], list[str | None]]:
    """The request's tokens and their finish reasons (None but the last)."""
    msg = GenerateRequest(id="r", prompt_ids=prompt, params=SamplingParams(max_new_tokens=3, **params), created_ms=0)
    engine.add(Req(msg=msg, inbox_id="1-0"))
    events = []
    while engine.has_work:
        events += flat(engine.step())
    assert not [e for e in events if isinstance(e, Ended)]  # nothing failed or was cancelled
    tokens = [e for e in events if isinstance(e, Token)]
    return [t.token_id for t in tokens], [t.finish_reason for t in tokens]


@pytest.mark.parametrize(
    "params",
    [
        {"repetition_penalty": 1.5},  # the red-team's request (issue 34)
        {"presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"min_new_tokens": 2},
        {"top_logprobs": 5},
    ],
)
def test_the_counting_stand_in_answers_a_prompt_id_beyond_its_logits(params):
    tokens, reasons = run(counting_engine(), [5, 6160], **params)
    assert tokens == expected_tokens(6160, 3, COUNTING_VOCAB)
    assert reasons == [None, None, "length"]


def test_prompt_logprobs_of_an_id_beyond_the_logits():
    """The id past the logits scores the floor (the model cannot produce it); before, the gather
    raised and killed the worker at each of the request's three attempts (red team 3)."""
    engine = counting_engine()
    msg = GenerateRequest(
        id="r", prompt_ids=[5, 6, 6160], params=SamplingParams(max_new_tokens=3, prompt_logprobs=2), created_ms=0
    )
    engine.add(Req(msg=msg, inbox_id="1-0"))
    records = []
    while engine.has_work:
        records += [e for e in engine.step() if isinstance(e, Tokens)]
    tokens = [t.token_id for t in flat(records) if isinstance(t, Token)]
    assert tokens == expected_tokens(6160, 3, COUNTING_VOCAB)
    scored = [p for r in records for p in r.prompts.values()]
    assert len(scored) == 1 and len(scored[0]) == 2
    (after_5, _), (after_6, _) = scored[0]
    assert after_5 == pytest.approx(0.0, abs=1e-3)  # 6 follows 5: a column of the logits, scored as usual
    assert after_6 == FLOOR_LOGPROB
