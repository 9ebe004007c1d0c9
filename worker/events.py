"""What the model loop hands to the publisher thread: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.schemas import FinishReason, GenerateRequest, RequestStatus


@dataclass(frozen=True)
class Started:
    """A request was admitted; the publisher sets up a decoder and stop matcher per sample."""

    request_id: str
    prompt_ids: list[int]
    resume_ids: list[int]
    stop_sequences: tuple[str, ...] = ()
    min_new_tokens: int = 0  # stop strings are not matched before this many tokens
    n: int = 1  # samples (choices 0..n-1)
    # A requeued group's progress, as in GenerateRequest: per choice its emitted tokens, the ended choices.
    group_resume: list[list[int]] = field(default_factory=list)
    finished_choices: tuple[int, ...] = ()

    @classmethod
    def of(cls, msg: GenerateRequest) -> "Started":
        return cls(msg.id, msg.prompt_ids, msg.resume_ids, msg.params.stop_sequences, msg.params.min_new_tokens,
                   msg.n, msg.group_resume, tuple(msg.finished_choices))

    @property
    def open_choices(self) -> list[int]:
        """The samples that run here (a requeued group's finished ones do not)."""
        return [c for c in range(self.n) if c not in self.finished_choices]

    def emitted(self, choice: int) -> list[int]:
        """Tokens sample ``choice`` emitted before this attempt (the client has them)."""
        if self.n == 1:
            return self.resume_ids
        return self.group_resume[choice] if self.group_resume else []


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
