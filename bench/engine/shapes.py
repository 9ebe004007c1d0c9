"""Model shapes for benchmarks with dummy weights (``--model-shape``).

Each entry is config.json's size fields under the checkpoint's own names
(BLOOM's are n_layer / n_head); ``ARCHITECTURES`` says which lightq model a
shape builds (Llama when absent). bench/engine/offline.py's transformers peer run
builds a LlamaConfig from these fields, so it fits the Llama shapes only.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

_LLAMA_70B = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama2-70b": dict(_LLAMA_70B, vocab_size=32000, rope_theta=10000.0, max_position_embeddings=4096),
    "llama3-70b": dict(_LLAMA_70B, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "bloom-7b1": dict(
        hidden_size=4096,
        n_layer=30,
        n_head=32,
        vocab_size=250880,
        layer_norm_epsilon=1e-5,
        apply_residual_connection_post_layernorm=False,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=28,
    ),
    # For smoke runs on a CPU.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
# shape -> (architecture, model_type) where not Llama's
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "bloom-7b1": ("BloomForCausalLM", "bloom"),
    "qwen2.5-7b": ("Qwen2ForCausalLM", "qwen2"),
}


def config_dir(shape: str, folder: str | None = None, tokenizer: bool = False, vocab_size: int | None = None) -> str:
    """A directory (``folder``, else a temporary one) holding the shape's config.json, for
    ``dummy:<dir>``; with ``tokenizer``, also a word-level tokenizer over the whole vocabulary
    (``word_tokenizer``), so the full stack can serve the shape: text in, every id decodable.
    ``vocab_size`` replaces the shape's (bench/engine/offline.py's grammar needs a real tokenizer's)."""
    if folder is None:  # ours: gone when this process ends (a bench, or the tests that call one)
        folder = tempfile.mkdtemp(prefix=f"lightq-{shape}-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)
    arch, model_type = ARCHITECTURES.get(shape, ("LlamaForCausalLM", "llama"))
    config = {
        "architectures": [arch],
        "model_type": model_type,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer:
        word_tokenizer(config["vocab_size"], folder)
    return folder


def word_tokenizer(vocab_size: int, folder: str) -> None:
    """tokenizer.json + tokenizer_config.json: ids 0-2 are <unk>, <s>, </s> (config.json's bos
    and eos), id i >= 3 is the word "w<i>"; words split on whitespace and decode space-joined.
    A stand-in for a real tokenizer where only the vocabulary's size matters (dummy weights)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 1 << 20,
            },
            f,
        )


def main() -> None:
    """python -m bench.engine.shapes SHAPE DIR [--tokenizer]: write a shape's config (for lightq serve)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("folder")
    parser.add_argument("--tokenizer", action="store_true", help="also a word-level tokenizer (word_tokenizer)")
    args = parser.parse_args()
    print(config_dir(args.shape, args.folder, args.tokenizer))


if __name__ == "__main__":
    main()
