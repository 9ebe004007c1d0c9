import torch

from shared.schemas import SamplingParams
from worker.runner.sampler import SamplingBatch, sample


def build(params, vocab):
    return SamplingBatch.build(params, vocab, torch.device("cpu"))


def test_greedy_rows_take_the_argmax_and_report_its_logprob():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ids, logprobs, _ = sample(logits, build([SamplingParams()] * 4, 50))
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected.double(), atol=1e-5)


def test_top_k_and_top_p_limit_the_support():
    torch.manual_seed(1)
    logits = torch.randn(1, 100).repeat(300, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    ids, _, _ = sample(logits, build([SamplingParams(do_sample=True, temperature=1.5, top_k=5)] * 300, 100))
    assert set(ids) <= top5 and len(set(ids)) > 1
    ids, _, _ = sample(logits, build([SamplingParams(do_sample=True, top_p=1e-6)] * 300, 100))
    assert set(ids) == {int(logits[0].argmax())}


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    params = [SamplingParams(), SamplingParams(do_sample=True, temperature=2.0)]
    for _ in range(20):
        ids, _, _ = sample(logits, build(params, 30))
        assert ids[0] == int(logits[0].argmax())


def test_sampling_follows_the_tempered_distribution():
    torch.manual_seed(3)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    ids, _, _ = sample(logits, build([SamplingParams(do_sample=True, temperature=0.5)] * 4000, 4))
    freq = torch.bincount(torch.tensor(ids), minlength=4).double() / 4000
    expected = torch.softmax(logits[0] / 0.5, -1).double()
    assert torch.allclose(freq, expected, atol=0.03)


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]])).repeat(2000, 1)
    ids, _, _ = sample(logits, build([SamplingParams(do_sample=True, min_p=0.2)] * 2000, 4))
    assert set(ids) == {0, 1, 2}  # 0.08 < 0.2 * 0.5
    freq = torch.bincount(torch.tensor(ids), minlength=4).double() / 2000
    assert torch.allclose(freq[:3], torch.tensor([0.5, 0.3, 0.12]).double() / 0.92, atol=0.04)


def seeded_ids(logits, params, output_lens=None):
    return sample(logits, SamplingBatch.build(params, logits.shape[-1], torch.device("cpu"), output_lens=output_lens))[
        0
    ]


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    torch.manual_seed(4)
    row = torch.randn(1000)
    mine = SamplingParams(do_sample=True, temperature=1.3, top_p=0.95, seed=1234)
    alone = [seeded_ids(row[None], [mine], [n])[0] for n in range(30)]
    for batch_size, position in [(5, 0), (7, 4), (3, 2)]:
        others = torch.randn(batch_size, 1000)
        others[position] = row
        params = [SamplingParams(do_sample=True, seed=None if i % 2 else 99 + i) for i in range(batch_size)]
        params[position] = mine
        together = [seeded_ids(others, params, [n] * batch_size)[position] for n in range(30)]
        assert together == alone
    assert len(set(alone)) > 5  # it does sample
    other_seed = [seeded_ids(row[None], [mine.model_copy(update={"seed": 1235})], [n])[0] for n in range(30)]
    assert other_seed != alone


def test_seeded_sampling_follows_the_distribution():
    logits = torch.tensor([[1.5, 1.0, 0.0, -0.5, -3.0]]).repeat(4000, 1)
    params = [SamplingParams(do_sample=True, temperature=0.8, seed=s) for s in range(4000)]
    ids = seeded_ids(logits, params)
    freq = torch.bincount(torch.tensor(ids), minlength=5).double() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.8, -1).double(), atol=0.03)
    # One seed over many steps follows it too (the output index changes the noise).
    steps = seeded_ids(logits, [params[0]] * 4000, list(range(4000)))
    freq = torch.bincount(torch.tensor(steps), minlength=5).double() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.8, -1).double(), atol=0.03)


def test_seeded_noise_is_exponential_and_keyed_by_token():
    from worker.runner.sampler import hash32, seed_key, seeded_noise

    values = torch.arange(1 << 16, dtype=torch.int64)
    assert hash32(values).unique().numel() == 1 << 16  # a bijection: no collisions
    assert [hash32(int(v)) for v in values[:5]] == hash32(values[:5]).tolist()  # host and device agree
    keys = torch.tensor([seed_key(7, 0), seed_key(7, 1), seed_key(-7, 0), seed_key(2**70, 0)])
    noise = seeded_noise(keys, 50_000)
    assert noise.min() > 0 and abs(noise.mean().item() - 1.0) < 0.02 and abs(noise.var().item() - 1.0) < 0.05
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    assert torch.equal(seeded_noise(keys[:1], 100)[0], noise[0, :100])  # a prefix of the vocab: same values


def test_a_non_finite_row_reports_finite_logprobs():
    # A row of NaN logits (what a float32 overflow made of a red team's parameters before the door
    # bounded them): the logprobs a chunk carries stay numbers, never JSON's null.
    logits = torch.randn(2, 30)
    logits[1] = float("nan")
    ids, logprobs, tops = sample(logits, build([SamplingParams(top_logprobs=3)] * 2, 30))
    assert all(isinstance(lp, float) and lp == lp for lp in logprobs)
    assert all(lp == lp and lp > float("-inf") for row in tops for _, lp in row)
