"""Request and response bodies of the producer's HTTP API.

The native routes copy LightLLM's formats (its ``server/api_lightllm.py``):
unknown parameters are ignored, ``generated_text`` is a list, and stream
events carry a ``token`` object. Request models are strict (no "5" -> 5), so a
wrong type is a 400 rather than a silent coercion.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, field_validator
from pydantic_core import PydanticCustomError

from shared.chunk_schemas import TokenChunk
from shared.schemas import MAX_PRIORITY, MIN_PRIORITY, FinishReason, RequestStatus

MAX_PENALTY = 1e4  # the native routes' bound on a penalty (OpenAI's routes: +-2)
# Past ~3.4e38 a temperature is inf in float32 and the sampled row NaN (EOS at index 0 with a null
# logprob, min_new_tokens broken; a red team's 1e39); 1e6 already makes every token equally likely.
MAX_TEMPERATURE = 1e6


class _Request(BaseModel):
    # No NaN or infinity: JSON cannot carry them on to the router (they would arrive as null).
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


# Bounds that keep a value representable where it goes (int64 seeds, int32 top-k tensors).
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_TIMEOUT_S = 86_400.0
TIMEOUT_DOC = (
    "seconds the request may wait in the queue; one still queued after that is not run and "
    "ends with finish_reason 'expired'"
)
PRIORITY_DOC = "scheduling class: lower is served earlier (as in vLLM); within a class tenants share tokens fairly"


class GenerateParameters(_Request):
    """LightLLM's ``parameters`` object; keys lightq does not implement are ignored.

    Ranges are LightLLM's (``SamplingParams.verify``); ``min_p`` is an extra
    (vLLM, SGLang). Cross-field rules live in ``producer.api.params``.
    """

    max_new_tokens: int | None = Field(None, ge=1)
    min_new_tokens: int | None = Field(None, ge=1, description="EOS cannot end the output before this")
    do_sample: bool = False
    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0: greedy, whatever do_sample says")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, le=INT32_MAX, description="-1 or 0: no top-k")
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX, description="-1 or null: unseeded")
    # LightLLM's lower bounds; the upper ones keep a penalty finite in float32 (1e39 became inf, and the
    # sampled row NaN: token 0 with a null logprob); the worker is fuzzed up to 1e6
    presence_penalty: float = Field(0.0, ge=0, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=0, le=MAX_PENALTY)
    repetition_penalty: float = Field(1.0, ge=1, le=MAX_PENALTY)
    stop_sequences: str | list[str | list[int]] | None = Field(
        None, description="a string, or a list of strings and token-id lists (at most 10)"
    )
    best_of: int | None = None
    n: int | None = None
    return_details: bool = Field(False, description="/generate: per-token id, text, logprob under 'tokens'")
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description=TIMEOUT_DOC)
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description=PRIORITY_DOC)
    # Constrained decoding, under LightLLM's names (at most one; producer.api.structured).
    guided_json: dict[str, Any] | str | None = Field(None, description="a JSON schema the output follows")
    regular_constraint: str | None = Field(None, description="a regular expression the output matches")
    guided_grammar: str | None = Field(None, description="an EBNF grammar (xgrammar's dialect) the output follows")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=20, description="/generate: each prompt token's logprob and this many alternatives"
    )
    adapter: str | None = Field(
        None, description="a LoRA adapter to generate with, by its --lora_modules name (null: the base model)"
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value < -1:  # -1 and 0 (LightLLM's greedy spelling) both mean no top-k
            raise PydanticCustomError("top_k_range", "must be -1 or 0 (disabled) or >= 1")
        return value


class GenerateBody(_Request):
    """Body of ``/generate``, ``/generate_stream`` and ``POST /v1/requests``."""

    inputs: str | list[int]
    parameters: GenerateParameters | None = None

    @field_validator("inputs", mode="wrap")
    @classmethod
    def _inputs(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> str | list[int]:
        try:
            return handler(value)
        except ValidationError:  # one clear message instead of one per union member
            raise PydanticCustomError("inputs_type", "must be a string or a list of token ids") from None

    @property
    def params(self) -> GenerateParameters:
        return self.parameters or GenerateParameters()


def _inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with ``$defs`` inlined (OpenAPI cannot resolve them in place)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    return inline(schema)


def body_doc(model: type[BaseModel]) -> dict:
    """``openapi_extra`` documenting a body a route parses itself (JSON: ``producer.edge.front_door``
    refuses other types)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": _inline_schema(model)}}}}


BODY_DOC = body_doc(GenerateBody)


class TokenDetail(BaseModel):
    id: int
    text: str
    logprob: float | None


class PromptTokenDetail(BaseModel):
    id: int
    logprob: float | None = Field(description="null for the first token (nothing predicts it)")
    top_logprobs: list[tuple[int, float]] = Field(default_factory=list, description="(id, logprob), likeliest first")


class GenerateResult(BaseModel):
    """``/generate``'s answer in LightLLM's shape: ``generated_text`` is always a list (one
    text per sample); the siblings are scalars for n=1 and lists (per sample) for n>1."""

    generated_text: list[str]
    count_output_tokens: int | list[int]
    finish_reason: FinishReason | None | list[FinishReason | None]
    prompt_tokens: int
    tokens: list[TokenDetail] | list[list[TokenDetail]] | None = Field(
        None, description="with return_details only (per sample for n>1)"
    )
    error: str | None = Field(None, description="set only when the request did not end normally")
    prompt_logprobs: list[PromptTokenDetail] | None = Field(None, description="with parameters.prompt_logprobs only")


def dump_without_empty_error(model: BaseModel) -> str:
    """JSON of a native-route body; LightLLM has no ``error`` key (nor ``tokens`` without
    return_details), so they appear only when set."""
    data = model.model_dump(mode="json")
    for key in ("error", "tokens", "prompt_logprobs"):
        if data.get(key) is None:
            data.pop(key, None)
    return json.dumps(data, ensure_ascii=False)


class StreamToken(BaseModel):
    id: int | None
    text: str
    logprob: float | None
    special: bool = Field(False, description="a special token (EOS, BOS, chat markers): its text is not output")
    count_output_tokens: int
    prompt_tokens: int


class StreamEvent(BaseModel):
    """One ``/generate_stream`` event (``data:{json}``)."""

    token: StreamToken
    generated_text: str | None = None
    finished: bool
    finish_reason: FinishReason | None
    details: Any = None
    error: str | None = None
    prompt_logprobs: list[PromptTokenDetail] | None = Field(
        None, description="with parameters.prompt_logprobs: on the first event only (the worker sends them with it)"
    )

    def to_json(self) -> str:
        return dump_without_empty_error(self)


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special token ids (BOS, EOS, chat markers): their events say ``special``."""
    return frozenset(getattr(tokenizer, "all_special_ids", None) or ())


def stream_event(
    chunk: TokenChunk,
    prompt_tokens: int,
    special: frozenset[int] = frozenset(),
    prompt_logprobs: list[PromptTokenDetail] | None = None,
) -> str:
    """A ``/generate_stream`` event exactly as LightLLM frames it: ``data:`` without a space;
    ``prompt_logprobs``: the prompt's scores, where this chunk brought them."""
    count = chunk.index + (chunk.token_id is not None)
    token = StreamToken(
        id=chunk.token_id,
        text=chunk.text,
        logprob=chunk.logprob,
        special=chunk.token_id in special,
        count_output_tokens=count,
        prompt_tokens=prompt_tokens,
    )
    event = StreamEvent(
        token=token,
        finished=chunk.finished,
        finish_reason=chunk.finish_reason,
        error=chunk.error,
        prompt_logprobs=prompt_logprobs,
    )
    return f"data:{event.to_json()}\n\n"


class SubmitAccepted(BaseModel):
    id: str
    status_url: str
    stream_url: str


class RequestView(BaseModel):
    """``GET /v1/requests/{id}``: the status hash plus the output so far."""

    id: str
    status: RequestStatus
    output_text: str = Field(description="the output so far (with n > 1: the first sample's)")
    output_texts: list[str] | None = Field(None, description="with n > 1: each sample's output so far, by choice")
    output_tokens: int
    prompt_tokens: int
    finish_reason: FinishReason | None
    error: str | None
    worker: str | None
    created_ms: int
    dispatched_ms: int | None
    taken_ms: int | None  # the worker read it from its inbox
    stepped_ms: int | None  # the worker step that admitted it ended
    started_ms: int | None
    finished_ms: int | None
    priority: int | None = Field(None, description="while queued: its class (router.order.ordering)")
    queue_position: int | None = Field(
        None, description="while queued and read by a router: requests served before it as things stand (0: next)"
    )
    estimated_wait_s: float | None = Field(
        None, description="with a position: (position + 1) / the pool's dispatches per second over the last minute"
    )


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape, used for every 4xx/5xx this service answers."""

    error: ErrorDetail
