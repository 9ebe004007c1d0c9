"""Parameter rules both APIs share, and LightLLM's cross-field checks.

Single-field ranges live on the request models (pydantic names the field);
what needs two fields or the tokenizer is checked here, before anything is
written, each with a 400 that names the parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from producer.api.api_types import GenerateParameters
from producer.api.errors import bad_request
from producer.api.structured import native_constraint
from shared.schemas import SamplingParams

MAX_STOP_SEQUENCES = 10  # LightLLM's MAX_STOP_SEQUENCES
MAX_STOP_TOKENS = 256  # LightLLM's STOP_SEQUENCE_MAX_LENGTH (token-id stop sequences)
MAX_STOP_CHARS = 1024  # a text stop string is held back while it may start: keep that bounded
MAX_BEST_OF = 8


def stop_strings(value: str | Sequence[str | Sequence[int]] | None, tokenizer: Any, param: str) -> tuple[str, ...]:
    """Stop sequences as texts: token-id lists are decoded; empty ones are dropped (as LightLLM does)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    if len(items) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"{param}: at most {MAX_STOP_SEQUENCES} stop sequences, got {len(items)}",
            param=param,
            code="too_many_stop_sequences",
        )
    texts: list[str] = []
    for n, item in enumerate(items):
        text = item if isinstance(item, str) else _decode_stop(list(item), tokenizer, f"{param}.{n}")
        if len(text) > MAX_STOP_CHARS:
            raise bad_request(
                f"{param}.{n}: a stop sequence may have at most {MAX_STOP_CHARS} characters",
                param=param,
                code="stop_sequence_too_long",
            )
        if text:
            texts.append(text)
    return tuple(dict.fromkeys(texts))


def _decode_stop(ids: list[int], tokenizer: Any, param: str) -> str:
    if not ids:
        return ""
    if len(ids) > MAX_STOP_TOKENS:
        raise bad_request(
            f"{param}: a stop sequence may have at most {MAX_STOP_TOKENS} tokens, got {len(ids)}",
            param=param,
            code="stop_sequence_too_long",
        )
    vocab_size = len(tokenizer)
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise bad_request(
            f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param, code="invalid_token_id"
        )
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not text:
        # Output text skips special tokens, so such a stop sequence could never match.
        raise bad_request(
            f"{param}: token ids {ids} decode to no text (special tokens are not part of the "
            f"output; EOS already ends a request unless ignore_eos is set)",
            param=param,
            code="invalid_stop_sequence",
        )
    return text


def check_min_tokens(min_new: int, max_new: int, param: str, max_name: str) -> None:
    if min_new > max_new:
        raise bad_request(
            f"{param} ({min_new}) must be <= {max_name} ({max_new})", param=param, code="invalid_min_tokens"
        )


def check_prompt_length(num_prompt_tokens: int, max_req_input_len: int, param: str) -> None:
    """LightLLM's ``--max_req_input_len`` (0: no limit of its own; max_req_total_len still applies)."""
    if max_req_input_len and num_prompt_tokens > max_req_input_len:
        raise bad_request(
            f"{param} has {num_prompt_tokens} tokens: more than max_req_input_len {max_req_input_len}",
            param=param,
            code="context_length_exceeded",
            reason="too_long",
        )


def check_group(n: int | None, best_of: int | None, param: str) -> int:
    """LightLLM's rule (n == best_of <= 8); the group's size (samples of the prompt)."""
    best_of = 1 if best_of is None else best_of
    n = best_of if n is None else n
    if not 1 <= best_of <= MAX_BEST_OF:
        raise bad_request(f"{param}best_of must be in [1, {MAX_BEST_OF}], got {best_of}", param=f"{param}best_of")
    if n != best_of:
        raise bad_request(f"{param}n ({n}) must equal {param}best_of ({best_of})", param=f"{param}n")
    return n


def native_sampling(p: GenerateParameters, default_max_new_tokens: int, tokenizer: Any) -> SamplingParams:
    """LightLLM's ``parameters`` object as wire parameters, after its cross-field checks
    (the group size is ``check_group``'s)."""
    max_new = p.max_new_tokens or default_max_new_tokens
    min_new = p.min_new_tokens or 0
    check_min_tokens(min_new, max_new, "parameters.min_new_tokens", "max_new_tokens")
    # LightLLM's greedy spellings: temperature 0 is greedy (as in OpenAI's API), top_k 0 is no top-k.
    greedy = p.temperature == 0
    return SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        do_sample=p.do_sample and not greedy,
        temperature=1.0 if greedy else p.temperature,
        top_p=p.top_p,
        top_k=-1 if p.top_k == 0 else p.top_k,
        min_p=p.min_p,
        ignore_eos=p.ignore_eos,
        seed=None if p.seed in (None, -1) else p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        stop_sequences=stop_strings(p.stop_sequences, tokenizer, "parameters.stop_sequences"),
        constraint=native_constraint(p.guided_json, p.regular_constraint, p.guided_grammar),
        prompt_logprobs=p.prompt_logprobs,
    )
