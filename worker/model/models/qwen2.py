"""Qwen2 / Qwen2.5: Llama's layers with a bias on q, k and v (none on o_proj);
the small ones (0.5B-3B) tie the output layer to the embedding, which the
base class handles from ``tie_word_embeddings``.

A sliding window applies only when ``use_sliding_window`` is set, and then
only to the layers transformers marks "sliding_attention" (by default those
from ``max_window_layers`` on); released Qwen2/2.5 configs leave it off.
"""

from __future__ import annotations

from worker.model.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def qkv_bias(cls, config) -> bool:
        return True

    @classmethod
    def o_bias(cls, config) -> bool:
        return False

    @classmethod
    def sliding_window(cls, config, layer: int) -> int | None:
        if not getattr(config, "use_sliding_window", False) or not getattr(config, "sliding_window", None):
            return None
        layer_types = getattr(config, "layer_types", None)
        sliding = (
            layer_types[layer] == "sliding_attention"
            if layer_types
            else layer >= getattr(config, "max_window_layers", 0)
        )
        return config.sliding_window if sliding else None
