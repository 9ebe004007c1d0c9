import torch

from shared.schemas import SamplingParams
from worker.sampler import SamplingBatch, sample


def build(params, vocab):
    return SamplingBatch.build(params, vocab, torch.device("cpu"))


def test_greedy_rows_take_the_argmax_and_report_its_logprob():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    ids, logprobs = sample(logits, build([SamplingParams()] * 4, 50))
    assert ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs, dtype=torch.float64), expected.double(), atol=1e-5)


def test_top_k_and_top_p_limit_the_support():
    torch.manual_seed(1)
    logits = torch.randn(1, 100).repeat(300, 1)
    top5 = set(logits[0].topk(5).indices.tolist())
    ids, _ = sample(logits, build([SamplingParams(do_sample=True, temperature=1.5, top_k=5)] * 300, 100))
    assert set(ids) <= top5 and len(set(ids)) > 1
    ids, _ = sample(logits, build([SamplingParams(do_sample=True, top_p=1e-6)] * 300, 100))
    assert set(ids) == {int(logits[0].argmax())}


def test_mixed_batch_keeps_greedy_rows_greedy():
    torch.manual_seed(2)
    logits = torch.randn(2, 30)
    params = [SamplingParams(), SamplingParams(do_sample=True, temperature=2.0)]
    for _ in range(20):
        ids, _ = sample(logits, build(params, 30))
        assert ids[0] == int(logits[0].argmax())


def test_sampling_follows_the_tempered_distribution():
    torch.manual_seed(3)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    ids, _ = sample(logits, build([SamplingParams(do_sample=True, temperature=0.5)] * 4000, 4))
    freq = torch.bincount(torch.tensor(ids), minlength=4).double() / 4000
    expected = torch.softmax(logits[0] / 0.5, -1).double()
    assert torch.allclose(freq, expected, atol=0.03)
