"""A request's state inside one worker (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from shared.schemas import FinishReason, GenerateRequest


class Phase(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # requests hash by identity
class Req:
    msg: GenerateRequest
    inbox_id: str
    output_ids: list[int] = field(default_factory=list)
    phase: Phase = Phase.WAITING
    row: int | None = None
    # slot_ids[p] is the pool slot of position p, for p < num_cached.
    slot_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    num_cached: int = 0
    # Set once the whole prompt (plus resumed output) is in the pool and a token
    # was sampled from it; from then on the request feeds one token a step.
    is_prefilled: bool = False
    # Paused (its slots taken back) and waiting to be prefilled again: its Started
    # event was already sent, so re-admission must not send another.
    is_paused: bool = False
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        # A request dispatched again continues after the tokens already emitted.
        self.output_ids = list(self.msg.resume_ids)

    @property
    def id(self) -> str:
        return self.msg.id

    @property
    def all_ids(self) -> list[int]:
        return self.msg.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.msg.prompt_ids) + len(self.output_ids)

    @property
    def num_uncached(self) -> int:
        """Tokens the next forward must feed: the whole prompt first, then one per step."""
        return self.num_tokens - self.num_cached

    @property
    def max_tokens_needed(self) -> int:
        return self.msg.max_tokens_needed

    @property
    def is_done_generating(self) -> bool:
        return len(self.output_ids) >= self.msg.params.max_new_tokens
