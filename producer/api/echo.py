"""``echo`` with ``logprobs`` in ``/v1/completions``: the prompt's own tokens in the logprobs, as OpenAI
(and lm-eval's ``local-completions`` loglikelihood) expect them.

The worker computes them from the prefill (``SamplingParams.prompt_logprobs``) and sends them with
the request's first output token (``TokenChunk.prompt_logprobs``): one (logprob, alternatives) pair
per prompt token after the first. Here they become the first entries of the choice's logprobs:
each prompt token's text, its logprob (None for the first, which nothing predicts, as OpenAI
answers), its alternatives (``{text: logprob}``, the token itself added) and its offset in the
echoed text. ``max_tokens: 0`` (score only) runs one token, which the answer leaves out.
"""

from __future__ import annotations

from typing import Any

from producer.api.openai_types import CompletionLogprobs
from shared.chunk_schemas import TokenChunk


def prompt_part(
    vocab: Any, prompt_ids: list[int], chunks: list[TokenChunk], top_of: Any, logprob_of: Any
) -> CompletionLogprobs:
    """The prompt's logprobs from the chunk that carries them (a choice of this prompt's request)."""
    scored = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
    if scored is None or len(scored) != len(prompt_ids) - 1:
        raise ValueError("the worker sent no prompt logprobs for an echo request")
    texts = [vocab.text(i) for i in prompt_ids]
    offsets, offset = [], 0
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    tops: list[dict[str, float] | None] = [None]
    for token_text, (lp, alternatives) in zip(texts[1:], scored):
        top: dict[str, float] = {}
        for token_id, value in alternatives:
            top.setdefault(top_of(token_id), logprob_of(value))
        top.setdefault(token_text, logprob_of(lp))
        tops.append(top)
    return CompletionLogprobs(
        tokens=texts,
        token_logprobs=[None, *(logprob_of(lp) for lp, _ in scored)],
        top_logprobs=tops,
        text_offset=offsets,
    )


def joined(prompt: CompletionLogprobs, output: CompletionLogprobs) -> CompletionLogprobs:
    """The prompt's entries, then the output's (whose offsets already count the echoed text)."""
    return CompletionLogprobs(
        tokens=[*prompt.tokens, *output.tokens],
        token_logprobs=[*prompt.token_logprobs, *output.token_logprobs],
        top_logprobs=[*(prompt.top_logprobs or []), *(output.top_logprobs or [])],
        text_offset=[*prompt.text_offset, *output.text_offset],
    )
