"""BLOOM, Qwen2 and Mistral (Llama has tests/worker/test_llama.py) against transformers.

Each tiny random transformers model is saved and loaded back through the
loader, so the registry, the checkpoint names and the fused layouts are what
is tested; lightq's model then runs through the real pool (packed prefill,
decode steps, a chunked prefill) and every logit row must match transformers'
on the same tokens. Two tests swap in the Triton backend (interpreter on CPU)
to check the model hands ALiBi slopes and the window to the kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from safetensors.torch import save_file

from shared.model_files import ModelSource, resolve
from tests.worker.model_harness import PoolRunner
from tests.worker.test_llama import _assert_close, _ref_last  # the same oracle and tolerance as Llama's
from worker.model.loader import attach_kv_cache, load_model
from worker.model.models import MODELS, model_class
from worker.model.triton_attention import TritonAttention

LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
BLOOM = dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256, layer_norm_epsilon=1e-5)
CONFIGS = {
    "bloom": (transformers.BloomConfig, BLOOM),
    # 6 heads: ALiBi's slopes for a head count off a power of two; the other residual wiring.
    "bloom-6heads-postln": (
        transformers.BloomConfig,
        dict(BLOOM, hidden_size=96, n_head=6, apply_residual_connection_post_layernorm=True),
    ),
    "qwen2-tied": (transformers.Qwen2Config, dict(LLAMA_LIKE, tie_word_embeddings=True)),
    # The window only on layers >= max_window_layers, as transformers marks them.
    "qwen2-sliding": (
        transformers.Qwen2Config,
        dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    # A window shorter than most prompts, so it cuts in prefill and in decode.
    "mistral": (transformers.MistralConfig, dict(LLAMA_LIKE, sliding_window=4, head_dim=16)),
    "mistral-no-window": (transformers.MistralConfig, dict(LLAMA_LIKE, sliding_window=None)),
}
PROMPT_LENS = (5, 11, 1, 8)


def _config(name: str):
    cls, kw = CONFIGS[name]
    arch = {"bloom": "BloomForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    return cls(**kw, architectures=[arch[cls.model_type]])


def _reference(name: str):
    """A seeded transformers model with every norm and bias randomised (they init to 1 and 0)."""
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return ref


def _pair(name: str, tmp_path):
    ref = _reference(name)
    ref.save_pretrained(tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu")
    assert type(model).__name__ == ref.config.architectures[0]
    return ref, model


def _step_and_check(ref, runner: PoolRunner, seqs: dict, new_tokens: dict) -> None:
    """One pool step; each request's logits must be transformers' on its whole sequence so far."""
    logits = runner.step(new_tokens)
    for row, (rid, ids) in enumerate(new_tokens.items()):
        seqs.setdefault(rid, []).extend(ids)
        _assert_close(logits[row], _ref_last(ref, seqs[rid]))


def _prefill_then_decode(ref, runner: PoolRunner, steps: int, seed: int) -> None:
    """Packed prefill of PROMPT_LENS prompts, then ``steps`` batched decode steps fed
    random tokens (so argmax ties cannot matter)."""
    vocab = ref.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    seqs: dict = {}
    _step_and_check(
        ref, runner, seqs, {b: torch.randint(vocab, (n,), generator=gen).tolist() for b, n in enumerate(PROMPT_LENS)}
    )
    for _ in range(steps):
        _step_and_check(
            ref, runner, seqs, {b: torch.randint(vocab, (1,), generator=gen).tolist() for b in range(len(PROMPT_LENS))}
        )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(name, tmp_path):
    ref, model = _pair(name, tmp_path)
    _prefill_then_decode(ref, PoolRunner(model), steps=4, seed=1)


@pytest.mark.parametrize("name", ["bloom", "qwen2-sliding", "mistral"])
def test_chunked_prefill_with_new_request(name, tmp_path):
    """Second chunk of one prompt (cached_lens > 0) packed with a fresh prompt and a decode."""
    ref, model = _pair(name, tmp_path)
    gen = torch.Generator().manual_seed(2)
    long, fresh, short = (torch.randint(256, (n,), generator=gen).tolist() for n in (19, 6, 3))
    runner, seqs = PoolRunner(model), {}
    _step_and_check(ref, runner, seqs, {"long": long[:7], "short": short})
    _step_and_check(ref, runner, seqs, {"long": long[7:], "fresh": fresh, "short": [5]})


@pytest.mark.parametrize("name", ["bloom-6heads-postln", "mistral"])
def test_triton_backend_gets_the_rules(name, tmp_path):
    """The same model over the Triton kernels: ALiBi slopes / the window must reach them."""
    ref, model = _pair(name, tmp_path)
    runner = PoolRunner(model)
    model.set_backend(TritonAttention(runner.cache))
    _prefill_then_decode(ref, runner, steps=1, seed=3)


def test_bloom_loads_bigscience_names(tmp_path):
    """bigscience's checkpoints are saved from BloomModel: no ``transformer.`` prefix, no lm_head."""
    ref = _reference("bloom")
    state = {
        k.removeprefix("transformer."): v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight"
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    ref.config.save_pretrained(tmp_path)
    model, _ = load_model(ModelSource("hf", str(tmp_path)), torch.float32, "cpu")
    assert model.lm_head.weight is model.transformer.word_embeddings.weight
    _assert_close(PoolRunner(model).step({0: [3, 1, 4, 1, 5]})[0], _ref_last(ref, [3, 1, 4, 1, 5]))


@pytest.mark.parametrize("name", ["bloom", "qwen2-tied", "mistral"])
def test_dummy_weights_run(name, tmp_path):
    _config(name).save_pretrained(tmp_path)
    model, _ = load_model(resolve(f"dummy:{tmp_path}"), torch.float32, "cpu", seed=3)
    norms = [p for n, p in model.named_parameters() if "norm" in n or "ln_f" in n]
    assert norms and all(bool((p == 1).all() or (p == 0).all()) for p in norms)  # weights 1, biases 0
    attach_kv_cache(model, 64, "cpu")
    logits = PoolRunner(model).step({0: [1, 2, 3], 1: [4]})
    assert logits.shape == (2, 256) and torch.isfinite(logits).all()


def test_registry_picks_by_architecture_then_model_type():
    for name in CONFIGS:
        config = _config(name)
        assert model_class(config).__name__ == config.architectures[0]
        assert model_class(SimpleNamespace(architectures=None, model_type=config.model_type)) is model_class(config)
    with pytest.raises(ValueError) as err:
        model_class(SimpleNamespace(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    assert all(arch in str(err.value) for arch in MODELS) and "GPT2LMHeadModel" in str(err.value)
