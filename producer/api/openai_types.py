"""Bodies of the OpenAI-compatible routes (``/v1/completions``, ``/v1/chat/completions``).

Requests are strict and ignore unknown keys, like the native ones. Fields
that would change the answer but are not implemented (``logit_bias``,
``suffix``, ``best_of > n``, prompt log-probabilities, the legacy
``functions``) get a 400 saying so rather than being silently ignored.
``response_format`` and ``tools`` are ``producer.api.structured``'s and
``producer.api.tools``'; vLLM's and SGLang's constraint fields (``guided_json`` and the
like) ``producer.api.guided``'s.
Extras beyond OpenAI's list follow vLLM: ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from producer.api.api_types import INT32_MAX, INT64_MAX, MAX_TIMEOUT_S, PRIORITY_DOC, TIMEOUT_DOC
from producer.api.errors import bad_request
from producer.api.guided import GuidedFields
from producer.api.params import MAX_BEST_OF, check_min_tokens, stop_strings
from producer.api.structured import ResponseFormat
from producer.api.tools import Tool, ToolCallIn, ToolChoice
from shared.schemas import MAX_PRIORITY, MIN_PRIORITY, Constraint, SamplingParams

MIN_REPETITION_PENALTY = 1e-3
GREEDY_BELOW = 1e-5  # temperature 0 (or this close) means greedy, as in LightLLM


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(GuidedFields):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extras (vLLM's names); top_k 0 or -1 disables it there, so both do here.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    # Below 1e-3 a penalty only overflows: 1e-40 is 0 in float32 and the sampled row NaN (a red team's
    # 1e-300: unreadable chunks, a 400 naming an internal field, a stream cut mid-way).
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description=TIMEOUT_DOC)  # lightq's own
    response_format: ResponseFormat | None = None
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description=PRIORITY_DOC)  # vLLM's extension

    def check_common(self) -> None:
        if self.num_choices > MAX_BEST_OF:
            raise bad_request(f"n must be in [1, {MAX_BEST_OF}], got {self.n}", param="n")
        if self.logit_bias:
            raise _unsupported("logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")

    def sampling(self, max_new_tokens: int, tokenizer: Any) -> SamplingParams:
        """Wire parameters; ``temperature`` 0 means greedy (OpenAI), its default 1 samples."""
        check_min_tokens(self.min_tokens, max_new_tokens, "min_tokens", "max_tokens")
        temperature = 1.0 if self.temperature is None else self.temperature
        greedy = temperature < GREEDY_BELOW
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_tokens,
            do_sample=not greedy,
            temperature=1.0 if greedy else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k if self.top_k not in (None, 0) else -1,
            min_p=self.min_p or 0.0,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            stop_sequences=stop_strings(self.stop, tokenizer, "stop"),
            top_logprobs=self.num_top_logprobs,
        )

    def requested_constraint(self) -> tuple[Constraint | None, str]:
        """The constraint asked for outside tools (``response_format``, or another server's field) and
        the field that asks; 400 when both ask."""
        formatted = self.response_format.constraint() if self.response_format is not None else None
        guided = self.guided()
        if guided is None:
            return formatted, "response_format"
        if formatted is not None:
            raise bad_request(f"response_format and {guided[1]}: give at most one constraint", param=guided[1])
        return guided

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives to report per token (each route reads its own field)."""
        return 0

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _unsupported(param: str, detail: str = "") -> Exception:
    return bad_request(f"{param}{detail} is not supported yet", param=param, code="unsupported_parameter")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0, description="0: score the prompt only (with echo and logprobs)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def check(self) -> None:
        self.check_common()
        if self.best_of is not None and self.best_of != self.num_choices:
            # OpenAI's best_of > n ranks candidates by log-probability; lightq returns every sample.
            raise _unsupported(
                "best_of",
                f" = {self.best_of} with n = {self.num_choices} (only best_of == n: "
                f"ranking samples is not implemented)",
            )
        if self.suffix:
            raise _unsupported("suffix")
        if self.stream and (self.max_tokens == 0 or (self.echo and self.logprobs is not None)):
            raise _unsupported("stream", " with max_tokens 0 or with echo and logprobs (ask without stream)")

    @property
    def num_top_logprobs(self) -> int:
        return self.logprobs or 0

    @property
    def prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token when the prompt's logprobs are asked for (echo + logprobs)."""
        return self.logprobs if self.echo and self.logprobs is not None else None


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # legacy: refused (producer.api.tools.plan_tools)
    function_call: Any = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")

    @property
    def num_top_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- answers ----


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None  # None for an echoed prompt's first token
    text_offset: list[int]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``tool_calls`` only when the model called (OpenAI's shape)."""
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lightq"
    root: str
    max_model_len: int = Field(description="max prompt + generated tokens per request (max_req_total_len)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
