import math

import torch

from shared.schemas import SamplingParams
from worker.runner.penalties import PenaltyBatch, TokenCounts
from worker.runner.sampler import SamplingBatch, sample

V = 40
EOS = 2
CPU = torch.device("cpu")


def reference(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """Penalties one token at a time, as HF/vLLM/LightLLM describe them (repetition first)."""
    out = list(logits)
    for token in range(len(out)):
        count = output.count(token)
        if token in prompt or count:
            rp = p.repetition_penalty
            out[token] = out[token] / rp if out[token] > 0 else out[token] * rp
        out[token] -= count * p.frequency_penalty + (count > 0) * p.presence_penalty
    if len(output) < p.min_new_tokens:
        out[EOS] = -math.inf
    return out


def started(counts: TokenCounts, rows, prompts, outputs) -> None:
    for row, prompt, output in zip(rows, prompts, outputs):
        counts.start(row, prompt, output)


def test_apply_matches_the_reference_for_a_mixed_batch():
    torch.manual_seed(0)
    counts = TokenCounts(max_rows=8, vocab_size=V, eos_ids={EOS}, device=CPU)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(),  # neutral row: untouched
        SamplingParams(repetition_penalty=1.7, max_new_tokens=20, min_new_tokens=4),
        SamplingParams(presence_penalty=1.0, frequency_penalty=2.0, repetition_penalty=1.2),
    ]
    rows = [5, 0, 3, 7]
    prompts = [[1, 4, 4, 9], [3, 3], [7, 8, 30], [11]]
    outputs = [[4, 12, 12, 12], [6], [30, 31], [11, 11, 20]]
    started(counts, rows, prompts, outputs)
    logits = torch.randn(4, V) * 3
    batch = PenaltyBatch.build(params, torch.tensor(rows), [len(o) for o in outputs], CPU)
    got = counts.apply(logits, batch)
    for i in range(4):
        expected = torch.tensor(reference(logits[i].tolist(), prompts[i], outputs[i], params[i]))
        assert torch.allclose(got[i], expected, atol=1e-5), i
    assert torch.equal(got[1], logits[1])
    assert got[2, EOS] == -math.inf and got[0, EOS] != -math.inf


def test_add_counts_a_whole_step_and_start_forgets_the_previous_holder():
    counts = TokenCounts(max_rows=4, vocab_size=V, eos_ids={EOS}, device=CPU)
    started(counts, [0, 1], [[5, 6], [7]], [[], []])
    counts.add(torch.tensor([0, 1]), torch.tensor([9, 9]))
    counts.add(torch.tensor([0, 1]), torch.tensor([9, 5]))
    out = counts.output_counts(torch.tensor([0, 1]))
    assert out[0, 9] == 2 and out[1, 9] == 1 and out[1, 5] == 1 and out[0, 5] == 0  # prompt is not output
    assert int(out.sum()) == 4
    counts.start(0, [1], [2, 2])  # a new request takes row 0
    out = counts.output_counts(torch.tensor([0]))
    assert out[0, 9] == 0 and out[0, 2] == 2 and int(out.sum()) == 2
    assert counts.counts[0].ne(0).sum() == 2  # token 1 (prompt) and token 2 (output)
    counts.reset([0, 1])
    assert counts.counts.abs().sum() == 0


def test_min_new_tokens_masks_eos_until_enough_tokens_are_out():
    counts = TokenCounts(max_rows=2, vocab_size=V, eos_ids={EOS, 3}, device=CPU)
    params = [SamplingParams(min_new_tokens=2, max_new_tokens=5)] * 2
    logits = torch.zeros(2, V)
    logits[:, EOS] = 10.0
    batch = PenaltyBatch.build(params, torch.tensor([0, 1]), [1, 2], CPU)
    got = counts.apply(logits, batch)
    assert got[0, EOS] == -math.inf and got[0, 3] == -math.inf
    assert got[1, EOS] == 10.0 and logits[0, EOS] == 10.0  # the input is not modified
    assert PenaltyBatch.build(params, torch.tensor([0, 1]), [2, 3], CPU) is None  # nothing to do


def test_sample_applies_penalties_and_counts_what_it_sampled():
    counts = TokenCounts(max_rows=2, vocab_size=V, eos_ids={EOS}, device=CPU)
    params = [SamplingParams(repetition_penalty=4.0), SamplingParams(frequency_penalty=5.0)]
    counts.start(0, [7], [])
    counts.start(1, [7], [])
    logits = torch.zeros(2, V)
    logits[:, 7] = 2.0  # the argmax, but in both prompts
    logits[:, 8] = 1.0
    batch = SamplingBatch.build(params, V, CPU, rows=[0, 1], output_lens=[0, 0])
    ids, logprobs, _ = sample(logits, batch, counts)
    assert ids == [8, 7]  # repetition counts the prompt; frequency counts only output
    expected = torch.log_softmax(torch.tensor([0.5 if t == 7 else logits[0, t].item() for t in range(V)]), -1)[8]
    assert math.isclose(logprobs[0], expected.item(), rel_tol=1e-5)
    assert counts.output_counts(torch.tensor([0, 1]))[[0, 1], [8, 7]].tolist() == [1, 1]
    # Next step: row 0's 8 is now penalised too (0.25 < 0.5); row 1 generated 7, so 2 - 5 < 1.
    ids, _, _ = sample(logits, SamplingBatch.build(params, V, CPU, rows=[0, 1], output_lens=[1, 1]), counts)
    assert ids == [7, 8]


def test_greedy_decoding_without_penalties_needs_no_counts():
    logits = torch.randn(3, V)
    batch = SamplingBatch.build([SamplingParams()] * 3, V, CPU, rows=[0, 1, 2], output_lens=[0, 0, 0])
    assert batch.penalties is None
    assert sample(logits, batch)[0] == logits.argmax(-1).tolist()
