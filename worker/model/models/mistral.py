"""Mistral: Llama's layers and checkpoint names, with a sliding attention window.

The window (``config.sliding_window``, 4096 on Mistral-7B-v0.1, null from
v0.2 on) is honoured by both attention backends: a query at position p sees
keys at p - W + 1 .. p, as transformers' sliding-window mask. The pool still
keeps every token's K/V (nothing is freed as it leaves the window), so the
context limit stays ``max_req_total_len``, not W.
"""

from __future__ import annotations

from worker.model.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def sliding_window(cls, config, layer: int) -> int | None:
        return getattr(config, "sliding_window", None)
