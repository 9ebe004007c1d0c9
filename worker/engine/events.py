"""What the model loop hands to the publisher process: plain data, no tensors.

A step's events are pickled once and written to the publisher's pipe, so
they stay small: a forward's sampled tokens are one ``Tokens`` record of
columns (lists the sampler already made), not an object per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas import FinishReason, GenerateRequest, RequestStatus


@dataclass(frozen=True)
class Started:
    """A request was admitted; the publisher sets up a decoder and stop matcher for each
    sample still open (``msg.open_choices``), after the tokens it emitted before a requeue."""

    msg: GenerateRequest
    taken_ms: int | None = None  # when the worker read it from its inbox (Unix ms)
    epoch: int = 0  # its dispatch's fencing token (shared.request_log): every write carries it

    @property
    def request_id(self) -> str:
        return self.msg.id


@dataclass(frozen=True)
class Token:
    """One sampled token: a row of ``Tokens``, built only where one is read (the publisher)."""

    request_id: str
    index: int
    token_id: int
    logprob: float
    finish_reason: FinishReason | None  # set on the sample's last token
    choice: int = 0
    top: list[tuple[int, float]] | None = None  # (id, logprob) alternatives, when the request asked
    prompt: list[tuple[float, list[tuple[int, float]]]] | None = None  # prompt logprobs, with a first token


@dataclass(frozen=True)
class Tokens:
    """One forward's sampled tokens as columns, a row per sampling request (its sample ``choice``,
    the token's ``index`` in that sample's output). Finish reasons and alternatives are sparse:
    only the rows that finished, or that asked for alternatives, have an entry."""

    request_ids: list[str]
    choices: list[int]
    indexes: list[int]
    token_ids: list[int]
    logprobs: list[float]
    reasons: dict[int, FinishReason]  # row -> why its sample ended with this token
    tops: dict[int, list[tuple[int, float]]]  # row -> (id, logprob) alternatives
    # row -> the prompt's logprobs (SamplingParams.prompt_logprobs), with its request's first token
    prompts: dict[int, list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Ended:
    """A request's sample that stopped without a final token (cancelled, failed)."""

    request_id: str
    status: RequestStatus
    reason: FinishReason
    num_output: int
    error: str | None = None
    choice: int = 0
    epoch: int = 0  # a request refused on arrival has no Started: its dispatch's epoch comes here


@dataclass(frozen=True)
class Released:
    """The request's inbox entry can go: it (every sample of a group) finished or ended here."""

    request_id: str
    inbox_id: str


@dataclass(frozen=True)
class Preempted:
    """The request was paused for a better class (``worker.engine.preempt``): after its tokens,
    ``msg`` (its output so far as ``resume_ids``) goes back to the queue and the inbox entry goes."""

    request_id: str
    inbox_id: str
    msg: GenerateRequest
    epoch: int = 0  # its dispatch's: the fence of one that never started here (no Started) takes it


Event = Started | Tokens | Ended | Released | Preempted
