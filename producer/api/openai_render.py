"""Token chunks as OpenAI answers: whole responses, and SSE chunks ending in ``[DONE]``.

Chunk text is already incremental and stop strings are already cut by the
worker, so a choice's text is the concatenation of its chunks' texts. A
request with ``n`` samples answers ``choices[i]`` from the chunks of
``choice`` i (streamed chunks carry that ``index``); usage counts the prompt
once and every choice's tokens. A completion of several prompts arrives
with choices already numbered ``prompt * n + sample`` (``MergedFollower``);
usage counts every prompt once.

Top log-probabilities arrive as (token id, logprob) pairs on each chunk
(``TokenChunk.top_logprobs``) and are rendered here, each id as its own
text: completions as ``{text: logprob}`` with the chosen token added (OpenAI:
up to ``logprobs`` + 1 entries), chat as ``[{token, logprob, bytes}]``.

A chat call with tools reads each choice's text as calls where the plan says
(``producer.api.tool_render``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from producer.api import echo
from producer.api.openai_types import (
    ChatChoice,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from producer.api.structured import failure
from producer.api.tool_render import ToolStream, chat_message
from producer.api.tools import ToolPlan
from producer.api.vocabulary import Vocabulary
from shared.chunk_schemas import TokenChunk

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}  # "abort": vLLM's name
NO_LOGPROB = -9999.0  # what OpenAI reports for a log-probability too small to show


@dataclass(frozen=True)
class Call:
    """One OpenAI request as the renderers need it."""

    kind: Literal["completion", "chat"]
    id: str
    created: int
    model: str
    prompt_tokens: int  # every prompt's, each counted once
    logprobs: bool
    include_usage: bool = False
    echo: tuple[str, ...] = ()  # completions with echo: each prompt's text
    n: int = 1  # choices per prompt
    num_prompts: int = 1  # completions: prompts listed; choice c answers prompt c // n
    tools: ToolPlan | None = None  # chat with tools offered (not "none")
    score_only: bool = False  # completions' max_tokens 0: the one generated token is left out
    prompt_ids: tuple[list[int], ...] = ()  # echo + logprobs: each prompt's ids (producer.api.echo)

    @property
    def num_choices(self) -> int:
        return self.n * self.num_prompts

    def echo_of(self, choice: int) -> str:
        return self.echo[choice // self.n] if self.echo else ""


def _logprob(value: float | None) -> float:
    return value if value is not None and math.isfinite(value) else NO_LOGPROB


def _token_str(vocab: Vocabulary, token_id: int) -> str:
    return vocab.text(token_id)


def _usage(call: Call, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=call.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=call.prompt_tokens + completion_tokens,
    )


def _raise_if_failed(last: TokenChunk) -> None:
    if last.finish_reason == "error":
        raise failure(last.error)  # a 400 when the worker could not apply the constraint, else a 500


def response(call: Call, chunks: list[TokenChunk], vocab: Vocabulary) -> CompletionResponse | ChatCompletionResponse:
    """The non-streaming answer (``call.num_choices`` choices) from all of a request's chunks."""
    by_choice = [[c for c in chunks if c.choice == i] for i in range(call.num_choices)]
    for own in by_choice:
        _raise_if_failed(own[-1])
    choices = [_choice(call, i, own, vocab, chunks) for i, own in enumerate(by_choice)]
    usage = _usage(call, 0 if call.score_only else sum(c.token_id is not None for c in chunks))
    if call.kind == "chat":
        return ChatCompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage)
    return CompletionResponse(id=call.id, created=call.created, model=call.model, choices=choices, usage=usage)


def _choice(
    call: Call, index: int, chunks: list[TokenChunk], vocab: Vocabulary, every: list[TokenChunk]
) -> ChatChoice | CompletionChoice:
    """One choice from its own chunks (the last one ends it); ``every``: the whole answer's, where an
    echoed prompt's logprobs are (with its request's first token, whichever choice that was)."""
    tokens = [chunk for chunk in chunks if chunk.token_id is not None and not call.score_only]
    text = "".join(chunk.text for chunk in tokens)
    reason = FINISH_REASONS.get(chunks[-1].finish_reason or "", chunks[-1].finish_reason)
    if call.score_only:
        reason = "length"
    if call.kind == "chat":
        logprobs = ChatLogprobs(content=[_chat_logprob(vocab, c) for c in tokens]) if call.logprobs else None
        message, reason = chat_message(call.tools, text, reason)
        return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)
    echo_text = call.echo_of(index)
    logprobs = _completion_logprobs(vocab, tokens, len(echo_text)) if call.logprobs else None
    if logprobs is not None and call.prompt_ids:
        siblings = [c for c in every if c.choice // call.n == index // call.n]
        prompt = echo.prompt_part(
            vocab, call.prompt_ids[index // call.n], siblings, lambda i: _token_str(vocab, i), _logprob
        )
        logprobs = echo.joined(prompt, logprobs)
    return CompletionChoice(index=index, text=echo_text + text, logprobs=logprobs, finish_reason=reason)


def _chat_top(vocab: Vocabulary, token_id: int, logprob: float | None) -> ChatTopLogprob:
    # The token's own bytes, not its text's: a byte of an emoji decodes alone to U+FFFD (red team 3).
    token = _token_str(vocab, token_id)
    return ChatTopLogprob(token=token, logprob=_logprob(logprob), bytes=vocab.raw(token_id))


def _chat_logprob(vocab: Vocabulary, chunk: TokenChunk) -> ChatTokenLogprob:
    chosen = _chat_top(vocab, chunk.token_id, chunk.logprob)
    top = [_chat_top(vocab, i, lp) for i, lp in chunk.top_logprobs or []]
    return ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top)


def _completion_top(vocab: Vocabulary, chunk: TokenChunk) -> dict[str, float]:
    """``{text: logprob}``, most likely first, then the chosen token if it is not among them
    (two ids with one text keep the likelier one, as a dict keyed by text must)."""
    top: dict[str, float] = {}
    for token_id, logprob in [*(chunk.top_logprobs or []), (chunk.token_id, chunk.logprob)]:
        top.setdefault(_token_str(vocab, token_id), _logprob(logprob))
    return top


def _completion_logprobs(vocab: Vocabulary, tokens: list[TokenChunk], offset: int) -> CompletionLogprobs:
    offsets = []
    for chunk in tokens:
        offsets.append(offset)
        offset += len(chunk.text)
    # Up to logprobs + 1 entries a position: the alternatives asked for, and the chosen token
    # (alone with logprobs=0, as OpenAI and vLLM answer).
    top = [_completion_top(vocab, c) for c in tokens]
    return CompletionLogprobs(
        tokens=[_token_str(vocab, c.token_id) for c in tokens],
        token_logprobs=[_logprob(c.logprob) for c in tokens],
        top_logprobs=top,
        text_offset=offsets,
    )


def _opening(tools: ToolStream | None, choice: int) -> dict[str, Any]:
    return tools.opening(choice) if tools is not None else {"role": "assistant", "content": ""}


def sse_data(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class StreamRenderer:
    """SSE events of one streamed request: ``start()``, ``chunk()`` per chunk, ``end()``."""

    def __init__(self, call: Call, vocab: Vocabulary) -> None:
        self.call, self.vocab = call, vocab
        self.completion_tokens = 0
        self.offsets = [0] * call.num_choices  # per choice: characters streamed so far (completions' text_offset)
        self.failed = False
        self.tools = ToolStream(call.tools, call.num_choices) if call.tools is not None else None

    def _event(self, choice: dict[str, Any] | None, index: int = 0) -> str:
        call = self.call
        body: dict[str, Any] = {
            "id": call.id,
            "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
            "created": call.created,
            "model": call.model,
            "choices": [] if choice is None else [{"index": index, **choice}],
        }
        if call.include_usage:
            body["usage"] = None
        return sse_data(body)

    def _text_choice(self, text: str, logprobs: Any = None, finish_reason: str | None = None) -> dict[str, Any]:
        if self.call.kind == "chat":
            delta = {"content": text} if text else {}
            return {"delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def start(self) -> list[str]:
        """Each choice's opening: its role (chat) or the echoed prompt (completions)."""
        if self.call.kind == "chat":  # OpenAI's first chunk of a choice names the role
            tools = self.tools
            return [
                self._event({"delta": _opening(tools, i), "logprobs": None, "finish_reason": None}, i)
                for i in range(self.call.num_choices)
            ]
        if self.call.echo:
            self.offsets = [len(self.call.echo_of(i)) for i in range(self.call.num_choices)]
            return [self._event(self._text_choice(self.call.echo_of(i)), i) for i in range(self.call.num_choices)]
        return []

    def chunk(self, chunk: TokenChunk) -> list[str]:
        if chunk.finish_reason == "error":
            if self.failed:  # a group's samples all end with it: one error event
                return []
            self.failed = True
            return [sse_data({"error": failure(chunk.error).detail.model_dump()})]
        reason = FINISH_REASONS.get(chunk.finish_reason, chunk.finish_reason) if chunk.finished else None
        logprobs = None
        if chunk.token_id is not None:
            self.completion_tokens += 1
            if self.call.logprobs:
                logprobs = self._logprobs(chunk)
        self.offsets[chunk.choice] += len(chunk.text)
        if self.tools is not None:
            delta, reason = self.tools.delta(chunk.choice, chunk.text, reason)
            if delta is None:
                return []
            return [self._event({"delta": delta, "logprobs": logprobs, "finish_reason": reason}, chunk.choice)]
        if not chunk.text and logprobs is None and reason is None:
            return []  # nothing to tell (text held back, or half a character)
        return [self._event(self._text_choice(chunk.text, logprobs, reason), chunk.choice)]

    def _logprobs(self, chunk: TokenChunk) -> dict[str, Any]:
        if self.call.kind == "chat":
            return {"content": [_chat_logprob(self.vocab, chunk).model_dump()]}
        return _completion_logprobs(self.vocab, [chunk], self.offsets[chunk.choice]).model_dump()

    def end(self) -> list[str]:
        events = []
        if self.call.include_usage and not self.failed:
            body = {
                "id": self.call.id,
                "object": "chat.completion.chunk" if self.call.kind == "chat" else "text_completion",
                "created": self.call.created,
                "model": self.call.model,
                "choices": [],
                "usage": _usage(self.call, self.completion_tokens).model_dump(),
            }
            events.append(sse_data(body))
        return [*events, DONE]
