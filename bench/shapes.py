"""Model shapes for benchmarks with dummy weights (``--model-shape``)."""

from __future__ import annotations

import json
import os
import tempfile

SHAPES: dict[str, dict] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "llama2-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # For smoke runs on a CPU.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def config_dir(shape: str) -> str:
    """A temporary directory holding the shape's config.json (for ``dummy:<dir>``)."""
    folder = tempfile.mkdtemp(prefix=f"lightq-{shape}-")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, **SHAPES[shape]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder
