"""What the model loop hands to the publisher thread: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass

from shared.schemas import FinishReason, GenerateRequest, RequestStatus


@dataclass(frozen=True)
class Started:
    """A request was admitted; the publisher sets up a decoder and stop matcher for each
    sample still open (``msg.open_choices``), after the tokens it emitted before a requeue."""

    msg: GenerateRequest
    taken_ms: int | None = None  # when the worker read it from its inbox (Unix ms)

    @property
    def request_id(self) -> str:
        return self.msg.id


@dataclass(frozen=True)
class Token:
    request_id: str
    index: int
    token_id: int
    logprob: float
    finish_reason: FinishReason | None  # set on the sample's last token
    choice: int = 0
    top: list[tuple[int, float]] | None = None  # (id, logprob) alternatives, when the request asked


@dataclass(frozen=True)
class Ended:
    """A request's sample that stopped without a final token (cancelled, failed)."""

    request_id: str
    status: RequestStatus
    reason: FinishReason
    num_output: int
    error: str | None = None
    choice: int = 0


@dataclass(frozen=True)
class Released:
    """The request's inbox entry can go: it (every sample of a group) finished or ended here."""

    request_id: str
    inbox_id: str


Event = Started | Token | Ended | Released
