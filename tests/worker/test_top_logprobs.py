"""Top log-probabilities (``SamplingParams.top_logprobs``): each row gets exactly
the k alternatives it asked for, equal to ``torch.topk(log_softmax(...))`` of
the distribution its chosen token's logprob comes from; rows that ask for
none get None. Checked on the sampler alone and through the engine against a
reference forward of the tiny random Llama."""

import pytest
import torch

from shared.schemas import SamplingParams
from tests.worker.test_engine import make_engine, req, tiny  # noqa: F401 (fixture)
from tests.worker.token_rows import flat
from worker.engine.events import Token
from worker.runner.penalties import TokenCounts
from worker.runner.sampler import SamplingBatch, sample

CPU = torch.device("cpu")


def assert_top(top, logprobs_row, k):
    want = torch.topk(logprobs_row.double(), k)
    assert [i for i, _ in top] == want.indices.tolist()
    assert torch.allclose(torch.tensor([v for _, v in top], dtype=torch.float64), want.values, atol=1e-5)


def test_sampler_reports_each_rows_ask_from_the_tempered_penalised_distribution():
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab)
    params = [
        SamplingParams(top_logprobs=5),
        SamplingParams(),
        SamplingParams(do_sample=True, temperature=0.6, seed=3, top_logprobs=2),
        SamplingParams(frequency_penalty=1.5, top_logprobs=3),
    ]
    counts = TokenCounts(max_rows=4, vocab_size=vocab, eos_ids=set(), device=CPU)
    favourite = int(logits[3].argmax())
    counts.start(3, [], [favourite, favourite])  # row 3 already produced its argmax twice
    batch = SamplingBatch.build(params, vocab, CPU, rows=[0, 1, 2, 3], output_lens=[0, 0, 0, 2])
    ids, chosen, top = sample(logits, batch, counts)
    penalised = logits[3].clone()
    penalised[favourite] -= 2 * 1.5
    references = [
        torch.log_softmax(logits[0], -1),
        None,
        torch.log_softmax(logits[2] / 0.6, -1),
        torch.log_softmax(penalised, -1),
    ]
    assert top[1] is None
    for row, k in [(0, 5), (2, 2), (3, 3)]:
        assert len(top[row]) == k
        assert_top(top[row], references[row], k)
        assert abs(chosen[row] - references[row][ids[row]].item()) < 1e-5  # the same scale
    assert top[0][0][0] == ids[0] and top[3][0][0] == ids[3] != favourite  # greedy: the best is chosen


def test_engine_top_logprobs_equal_a_reference_forward(tiny):
    ref, folder = tiny
    engine = make_engine(folder)
    prompts = {"five": [5, 6, 7, 8, 9], "none": [11, 3], "hot": list(range(20, 30))}
    engine.add(req("five", prompts["five"], 6, top_logprobs=5))
    engine.add(req("none", prompts["none"], 4))
    engine.add(req("hot", prompts["hot"], 5, do_sample=True, temperature=0.7, seed=9, top_logprobs=2))
    tokens: dict[str, list[Token]] = {}
    while engine.has_work:
        for event in flat(engine.step()):
            if isinstance(event, Token):
                tokens.setdefault(event.request_id, []).append(event)
    assert all(t.top is None for t in tokens["none"])
    for rid, k, temperature in [("five", 5, 1.0), ("hot", 2, 0.7)]:
        out = [t.token_id for t in tokens[rid]]
        with torch.no_grad():  # one reference forward over prompt + output: position i predicts token i
            logits = ref(torch.tensor([prompts[rid] + out])).logits[0, len(prompts[rid]) - 1 : -1].float()
        reference = torch.log_softmax(logits / temperature, -1)
        for i, token in enumerate(tokens[rid]):
            assert len(token.top) == k
            assert_top(token.top, reference[i], k)
            assert abs(token.logprob - reference[i, token.token_id].item()) < 1e-4
        if rid == "five":  # greedy: the chosen token is the most likely alternative
            assert all(t.top[0] == (t.token_id, t.top[0][1]) for t in tokens[rid])


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_token_tied_with_others_is_listed_first_among_its_ties(device, dtype):
    """bf16 logits tie often (the embedded model on a CPU with bf16, every GPU model): the token a
    greedy row took (the argmax: the lowest id among ties) heads its alternatives and is never left
    out of them for another token of the same logprob. On CUDA too (another topk, another argmax)."""
    vocab = 12
    logits = torch.zeros(3, vocab, dtype=dtype, device=device)
    logits[0, [3, 7, 9]] = 2.0  # three-way tie for the max: the argmax is 3
    logits[1, [5, 6]] = 1.5  # two-way tie, and a better token
    logits[1, 10] = 4.0
    logits[2, [2, 4, 8, 11]] = 0.5  # ties at the max, k smaller than the ties
    params = [SamplingParams(top_logprobs=2), SamplingParams(top_logprobs=3), SamplingParams(top_logprobs=1)]
    batch = SamplingBatch.build(params, vocab, torch.device(device), rows=[0, 1, 2], output_lens=[0, 0, 0])
    for _ in range(20):  # topk's order among ties is not fixed: ask again
        ids, chosen, top = sample(logits, batch)
        assert ids == [3, 10, 2]
        assert [i for i, _ in top[0]][0] == 3 and top[0][0][1] == top[0][1][1] == chosen[0]
        assert [i for i, _ in top[1]][:1] == [10] and {i for i, _ in top[1][1:]} == {5, 6}
        assert [i for i, _ in top[2]] == [2] and top[2][0][1] == chosen[2]
