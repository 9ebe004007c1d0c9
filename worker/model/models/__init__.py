"""Model implementations by transformers architecture name, one file each.

``model_class`` reads config.json's ``architectures``; a config without them
(GGUF-derived ones) is matched by its ``model_type``.
"""

from __future__ import annotations

from worker.model.models.bloom import BloomForCausalLM
from worker.model.models.llama import LlamaForCausalLM
from worker.model.models.mistral import MistralForCausalLM
from worker.model.models.qwen2 import Qwen2ForCausalLM

MODELS: dict[str, type] = {
    cls.__name__: cls for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, BloomForCausalLM)
}
_BY_MODEL_TYPE: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "bloom": BloomForCausalLM,
}


def model_class(config) -> type:
    """The lightq class for a transformers config; ValueError naming the supported ones otherwise."""
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODELS:
            return MODELS[arch]
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(
        f"unsupported model: architectures={architectures or None}, model_type={model_type}; "
        f"supported architectures: {', '.join(sorted(MODELS))} "
        f"(or, without architectures, model_type {', '.join(sorted(_BY_MODEL_TYPE))})"
    )
