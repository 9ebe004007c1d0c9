"""lightq's Llama vs transformers' on tiny random models, through the loader and the real pool."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers

from shared.model_files import ModelSource, resolve
from tests.worker.model_harness import PoolRunner, build_batch
from worker.model.attention import make_backend
from worker.model.kv_cache import KVCache
from worker.model.layers import packs, rope_inv_freq, rope_parameters
from worker.model.loader import attach_kv_cache, load_model
from worker.model.models import model_class
from worker.model.models.llama import LlamaForCausalLM

BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
CONFIGS = {
    "mha-untied": dict(tie_word_embeddings=False),
    "gqa-tied-headdim": dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, num_hidden_layers=3
    ),
    "gqa-llama3-rope": dict(num_key_value_heads=2, vocab_size=512, rope_parameters=LLAMA3_ROPE),
    "bias": dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True),
}
PROMPT_LENS = (5, 11, 1, 8)


def _pair(
    config_kw: dict, tmp_path, dtype: torch.dtype = torch.float32
) -> tuple[transformers.LlamaForCausalLM, LlamaForCausalLM]:
    """A seeded transformers model, saved, and lightq's loaded from the save via the loader."""
    config = transformers.LlamaConfig(**{**BASE, **config_kw}, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms init to 1 and biases to 0: randomise them so they count
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ref.config._attn_implementation = "eager"
    ref.save_pretrained(tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), dtype, "cpu")
    return ref.to(dtype), model


@torch.no_grad()
def _ref_last(ref, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0, -1].float()


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=1e-4 * max(scale, 1.0), rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name, tmp_path):
    ref, model = _pair(CONFIGS[name], tmp_path)
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    runner = PoolRunner(model)

    logits = runner.step(dict(enumerate(prompts)))  # packed prefill
    for b, ids in enumerate(prompts):
        _assert_close(logits[b], _ref_last(ref, ids))

    seqs = [list(p) for p in prompts]
    for _ in range(4):  # decode steps, fed random tokens (independent of argmax ties)
        new = torch.randint(vocab, (len(seqs),), generator=gen).tolist()
        logits = runner.step({b: [t] for b, t in enumerate(new)})
        for b, t in enumerate(new):
            seqs[b].append(t)
            _assert_close(logits[b], _ref_last(ref, seqs[b]))


def test_bf16_on_the_cpu_matches_transformers_in_bf16(tmp_path):
    """``--dtype bfloat16`` on a CPU (its decode matmuls on packed bf16 weights where the CPU runs
    bf16: ``SmallBatchGemm``) against transformers in bf16 on the same weights, to bf16's precision."""
    ref, model = _pair(CONFIGS["gqa-tied-headdim"], tmp_path, torch.bfloat16)
    packed = [m.small is not None for m in model.modules() if hasattr(m, "small")]
    assert packed and all(packed) == packs(torch.bfloat16)  # the packed path runs where the CPU has bf16
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(ref.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    runner = PoolRunner(model)
    seqs = [list(p) for p in prompts]
    logits = runner.step(dict(enumerate(prompts)))
    for _ in range(3):  # the prefill, then two decode steps
        for b, ids in enumerate(seqs):
            want = _ref_last(ref, ids)
            got = logits[b].float()
            torch.testing.assert_close(got, want, atol=3e-2 * max(want.abs().max().item(), 1.0), rtol=3e-2)
        new = torch.randint(ref.config.vocab_size, (len(seqs),), generator=gen).tolist()
        for b, t in enumerate(new):
            seqs[b].append(t)
        logits = runner.step({b: [t] for b, t in enumerate(new)})


def test_chunked_prefill_with_new_request(tmp_path):
    """Second chunk of one prompt (cached_lens > 0) packed with a fresh prompt and a decode."""
    ref, model = _pair(CONFIGS["gqa-llama3-rope"], tmp_path)
    gen = torch.Generator().manual_seed(2)
    long, fresh, short = (torch.randint(512, (n,), generator=gen).tolist() for n in (19, 6, 3))
    runner = PoolRunner(model)
    first = runner.step({"long": long[:7], "short": short})
    _assert_close(first[0], _ref_last(ref, long[:7]))
    logits = runner.step({"long": long[7:], "fresh": fresh, "short": [5]})
    _assert_close(logits[0], _ref_last(ref, long))
    _assert_close(logits[1], _ref_last(ref, fresh))
    _assert_close(logits[2], _ref_last(ref, short + [5]))


def test_llama3_rope_scaling_changes_frequencies():
    config = transformers.LlamaConfig(**BASE, rope_parameters=LLAMA3_ROPE)
    scaled, _ = rope_inv_freq(config, 16)
    plain, _ = rope_inv_freq(SimpleNamespace(rope_theta=500000.0, rope_scaling=None), 16)
    assert scaled.shape == plain.shape == (8,)
    # the lowest frequencies (wavelength > 16 / low_freq_factor) are divided by factor
    torch.testing.assert_close(scaled[-1], plain[-1] / 8)


def test_rope_parameters_old_format():
    old = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}
    assert rope_parameters(SimpleNamespace())["rope_type"] == "default"


def test_model_class_choice():
    assert model_class(SimpleNamespace(architectures=None, model_type="llama")) is LlamaForCausalLM
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))


def test_load_weights_rejects_incomplete(tmp_path):
    config = transformers.LlamaConfig(**BASE)
    model = LlamaForCausalLM(config, torch.float32, "cpu")
    with pytest.raises(ValueError, match="lacks"):
        model.load_weights([("model.norm.weight", torch.ones(64))])
    with pytest.raises(KeyError):
        model.load_weights([("model.nonsense.weight", torch.ones(64))])


def test_dummy_weights_run(tmp_path):
    transformers.LlamaConfig(**{**BASE, "num_key_value_heads": 2}).save_pretrained(tmp_path)
    source = resolve(f"dummy:{tmp_path}")
    model, _ = load_model(source, torch.float32, "cpu", seed=3)
    again, _ = load_model(source, torch.float32, "cpu", seed=3)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q) and p.abs().sum() > 0, name
    cache = attach_kv_cache(model, 64, "cpu")
    assert cache.buffer.shape == (2, 65, 4, 16) and model.backend.cache is cache
    runner = PoolRunner(model)
    logits = runner.step({0: [1, 2, 3], 1: [4]})
    assert logits.shape == (2, 256) and torch.isfinite(logits).all()


# --- KVCache and TorchAttention against a dense reference -------------------


def test_kv_cache_layout():
    cache = KVCache(3, 10, 2, 4, torch.float16, "cpu")
    assert cache.buffer.shape == (3, 11, 4, 4) and cache.hold_slot == 10
    cache.k(1)[5] = 1.0
    cache.v(1)[5] = 2.0
    assert (cache.buffer[1, 5, :2] == 1).all() and (cache.buffer[1, 5, 2:] == 2).all()
    assert KVCache.bytes_per_token(3, 2, 4, torch.float16) == 2 * 2 * 4 * 3 * 2


def _dense_attention(q, keys, values, cached: int) -> torch.Tensor:
    """q [n, Hq, D] at positions cached.., over keys/values [L, Hkv, D]: the textbook formula."""
    n, hq, d = q.shape
    group = hq // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [L, Hq, D]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), keys.double()) / d**0.5
    causal = torch.arange(keys.shape[0])[None, :] <= cached + torch.arange(n)[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, values.double()).float()


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("decode", [False, True])
def test_torch_attention_vs_dense(hq, hkv, decode):
    """Random requests with cached context; never-written slots hold NaN and must not leak."""
    d, layer = 8, 1
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    cache = KVCache(2, 64, hkv, d, torch.float32, "cpu")
    cache.buffer.fill_(float("nan"))
    backend = make_backend(cache, "cpu")
    table = torch.full((4, 32), cache.hold_slot, dtype=torch.int32)
    cached = [0, 5, 9] if not decode else [3, 12, 7]
    q_lens = [4, 3, 1] if not decode else [1, 1, 1]
    slots = torch.randperm(64, generator=gen)
    rows, context, new_slots, start = [2, 0, 1], [], [], 0
    for row, c, n in zip(rows, cached, q_lens):
        table[row, : c + n] = slots[start : start + c + n].int()
        ctx_k, ctx_v = (torch.randn(c, hkv, d, generator=gen) for _ in range(2))
        cache.k(layer)[table[row, :c].long()] = ctx_k
        cache.v(layer)[table[row, :c].long()] = ctx_v
        context.append((ctx_k, ctx_v))
        new_slots.append(table[row, c : c + n])
        start += c + n
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=gen)
    k, v = torch.randn(T, hkv, d, generator=gen), torch.randn(T, hkv, d, generator=gen)
    batch = build_batch(table, rows, cached, [[0] * n for n in q_lens], [s.numpy() for s in new_slots])
    out = backend.forward(layer, q, k, v, batch)

    assert out.shape == q.shape and torch.isfinite(out).all()
    s = 0
    for (ctx_k, ctx_v), c, n in zip(context, cached, q_lens):
        keys, values = torch.cat((ctx_k, k[s : s + n])), torch.cat((ctx_v, v[s : s + n]))
        torch.testing.assert_close(
            out[s : s + n], _dense_attention(q[s : s + n], keys, values, c), atol=1e-5, rtol=1e-5
        )
        s += n
    assert torch.isnan(cache.buffer[0]).all(), "another layer was written"
