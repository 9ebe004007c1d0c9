"""The chunk stream's entries, serialised as JSON by ``shared.codec`` (reading a stream: ``shared.chunks``).

worker --ChunkRun--> {rN-K}:ID:chunks (durable) and {rN-K}:ID:tokens (pub/sub); readers see TokenChunks
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from shared.schemas import FinishReason, FrozenModel


class TokenChunk(FrozenModel):
    """One generated token; ``index`` is its 0-based position in the output
    of sample ``choice`` (always 0 unless the request is a group, n > 1).

    The last chunk of a sample has ``finished`` set; a request is done when
    every choice is. A request that ends without a token of its own
    (cancelled, failed, expired) gets a chunk whose ``token_id`` is None,
    ``text`` empty and ``index`` the count of tokens before it: such a chunk
    ends every choice of the request that has not finished. Readers drop a
    chunk whose (choice, index) they already delivered.

    ``top_logprobs``: when the request asked for alternatives
    (``SamplingParams.top_logprobs``), the most likely tokens at this
    position as (token id, logprob), most likely first, from the same
    distribution as ``logprob``; absent from the JSON otherwise.
    """

    kind: Literal["chunk"] = "chunk"
    request_id: str
    index: int
    choice: int = 0
    token_id: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # With the first token of a request that asked (SamplingParams.prompt_logprobs): per prompt
    # token after the first, (its logprob, (id, logprob) alternatives most likely first).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None

    @classmethod
    def built(cls, values: dict[str, Any]) -> TokenChunk:
        """A chunk from values a validated ``ChunkRun`` holds (every field given): what
        ``model_construct`` does without its per-field pass, a fifth of its time. A reader makes
        one per token delivered."""
        chunk = cls.__new__(cls)
        object.__setattr__(chunk, "__dict__", values)
        object.__setattr__(chunk, "__pydantic_fields_set__", set(values))
        object.__setattr__(chunk, "__pydantic_extra__", None)
        object.__setattr__(chunk, "__pydantic_private__", None)
        return chunk

    @model_serializer(mode="wrap")
    def _without_empty_top(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """One chunk per token goes over Redis: no ``top_logprobs: null`` on every one."""
        data: dict[str, Any] = handler(self)
        for key in ("top_logprobs", "prompt_logprobs"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


CHUNK_FORMAT: Literal[2] = 2  # the chunk entries workers write: 1, a TokenChunk per token; 2, a ChunkRun per run


class ChunkRun(FrozenModel):
    """A chunk stream entry of format 2: consecutive tokens of one sample, written at once.

    The tokens are ``index``, ``index + 1``, ... of sample ``choice``; ``token_ids``,
    ``texts`` and ``logprobs`` have one item each (``top_logprobs`` too, when the request
    asked for alternatives). A run with ``finished`` set ends its sample with its last
    token; a run without tokens is an end of its own (cancelled, failed, expired: see
    ``TokenChunk``, which is what readers make of a run, one per token, ``tokens()``).
    Format 1 entries (a ``TokenChunk`` each) are read as runs of one (``shared.chunks``).
    """

    kind: Literal["run"] = "run"
    v: Literal[2] = CHUNK_FORMAT
    request_id: str
    choice: int = 0
    index: int = Field(ge=0, description="the first token's index (the tokens before it, for a run without tokens)")
    token_ids: list[int] = Field(default_factory=list)
    texts: list[str] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # with the sample's token 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_columns(self) -> ChunkRun:
        n = len(self.token_ids)
        tops = n if self.top_logprobs is None else len(self.top_logprobs)
        if len(self.texts) != n or len(self.logprobs) != n or tops != n:
            raise ValueError("a run has one text, logprob (and top_logprobs entry) per token id")
        if n == 0 and not self.finished:
            raise ValueError("a run without tokens must end its sample")
        return self

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("top_logprobs", "prompt_logprobs", "finish_reason", "error"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def tokens(self) -> list[TokenChunk]:
        """The run as readers take it: a chunk per token (the last one ``finished`` when the run
        is), or the one tokenless chunk of an end without a token."""
        rid, choice, first = self.request_id, self.choice, self.index
        if not self.token_ids:
            return [TokenChunk.built(_chunk(rid, first, choice, None, "", None, None, None, True, self))]
        last = len(self.token_ids) - 1
        tops, texts, logprobs = self.top_logprobs, self.texts, self.logprobs
        prompt = self.prompt_logprobs if first == 0 else None
        return [
            TokenChunk.built(
                _chunk(
                    rid,
                    first + i,
                    choice,
                    token_id,
                    texts[i],
                    logprobs[i],
                    tops[i] if tops is not None else None,
                    prompt if i == 0 else None,
                    self.finished and i == last,
                    self if i == last else None,
                )
            )
            for i, token_id in enumerate(self.token_ids)
        ]

    @classmethod
    def of(cls, chunk: TokenChunk) -> ChunkRun:
        """A format-1 entry as the run of its one token (or its tokenless end)."""
        has_token = chunk.token_id is not None
        return cls.model_construct(
            kind="run",
            v=CHUNK_FORMAT,
            request_id=chunk.request_id,
            choice=chunk.choice,
            index=chunk.index,
            token_ids=[chunk.token_id] if chunk.token_id is not None else [],
            texts=[chunk.text] if has_token else [],
            logprobs=[chunk.logprob] if has_token else [],
            top_logprobs=[chunk.top_logprobs] if has_token and chunk.top_logprobs is not None else None,
            prompt_logprobs=chunk.prompt_logprobs,
            finished=chunk.finished,
            finish_reason=chunk.finish_reason,
            error=chunk.error,
        )


def _chunk(
    request_id: str,
    index: int,
    choice: int,
    token_id: int | None,
    text: str,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    prompt: list[tuple[float, list[tuple[int, float]]]] | None,
    finished: bool,
    end: ChunkRun | None,
) -> dict[str, Any]:
    """A ``TokenChunk``'s fields, every one of them; ``end``: the run whose end this token carries."""
    return {
        "kind": "chunk",
        "request_id": request_id,
        "index": index,
        "choice": choice,
        "token_id": token_id,
        "text": text,
        "logprob": logprob,
        "top_logprobs": top,
        "prompt_logprobs": prompt,
        "finished": finished,
        "finish_reason": end.finish_reason if end is not None else None,
        "error": end.error if end is not None else None,
    }
