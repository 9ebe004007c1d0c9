"""Model implementations by transformers architecture name."""

from __future__ import annotations

from worker.models.llama import LlamaForCausalLM

MODELS: dict[str, type] = {"LlamaForCausalLM": LlamaForCausalLM}
# GGUF-derived configs carry no ``architectures``; their model_type decides.
_BY_MODEL_TYPE: dict[str, type] = {"llama": LlamaForCausalLM}


def model_class(config) -> type:
    """The lightq class for a transformers config; ValueError when unsupported."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in MODELS:
            return MODELS[arch]
    if not getattr(config, "architectures", None) and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[config.model_type]
    raise ValueError(
        f"unsupported model: architectures={getattr(config, 'architectures', None)}, "
        f"model_type={getattr(config, 'model_type', None)}; supported architectures: {sorted(MODELS)}")
