"""A request's state inside one worker (no torch).

A group (``msg.n`` > 1) enters as one ``Req``, its leader (choice 0), which
prefills the prompt alone. When the prompt is complete the engine forks the
other n - 1 samples (``fork_members``): each gets its own table row whose
first ``num_shared`` positions point at the leader's prompt slots, which
``Group`` then owns. Invariant: ``Group.holders`` is the number of members
whose rows still point at ``Group.prompt_slots``; the slots go back to the
pool exactly when it drops to 0 (``ModelRunner.finish``). A paused member
lets go of the shared prompt and is later prefilled again on its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from shared.schemas import FinishReason, GenerateRequest


def member_seed(seed: int | None, choice: int) -> int | None:
    """Sample ``choice``'s seed: the request's own for choice 0 (so n=1 is unchanged),
    a distinct derived one for the others, so a seeded group is reproducible."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)


@dataclass(eq=False)
class Group:
    """What a group's samples share on this worker."""

    size: int
    live: int  # samples not ended yet (the unforked leader stands for all): the inbox entry goes with the last
    forked: bool = False
    prompt_slots: np.ndarray | None = None  # the leader's prompt slots, from the fork on
    holders: int = 0  # members whose table rows point at prompt_slots


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
    choice: int = 0  # which sample of its request (always 0 unless a group)
    group: Group | None = None  # None for n = 1
    num_shared: int = 0  # leading positions whose slots are group.prompt_slots (not ours to free)

    def __post_init__(self) -> None:
        # A request dispatched again continues after the tokens already emitted.
        self.output_ids = list(self.msg.resume_ids)
        if self.msg.n > 1 and self.group is None:
            self.group = Group(size=self.msg.n, live=1)

    @property
    def is_unforked_leader(self) -> bool:
        return self.group is not None and not self.group.forked

    def fork_members(self) -> list["Req"]:
        """The group's other samples, each with its own params (derived seed) and no slots yet."""
        params = self.msg.params
        members = []
        for choice in range(1, self.group.size):
            msg = self.msg.model_copy(update={"params": params.model_copy(update={"seed": member_seed(params.seed,
                                                                                                        choice)})})
            members.append(Req(msg=msg, inbox_id=self.inbox_id, choice=choice, group=self.group))
        return members

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
    def max_len(self) -> int:
        """Positions one sample can reach: prompt + max_new_tokens."""
        return len(self.msg.prompt_ids) + self.msg.params.max_new_tokens

    @property
    def is_done_generating(self) -> bool:
        return len(self.output_ids) >= self.msg.params.max_new_tokens
