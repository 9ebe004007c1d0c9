"""A request's state inside one worker (no torch).

A group (``msg.n`` > 1) enters as one ``Req``, its leader, which prefills
the prompt alone. When the prompt is complete the engine forks the other
samples (``fork_members``): each gets its own table row whose first
``num_shared`` positions point at the leader's prompt slots, which
``Group`` then owns. Invariant: ``Group.holders`` is the number of members
whose rows still point at ``Group.prompt_slots``; the slots go back to the
pool exactly when it drops to 0 (``ModelRunner.finish``). A member paused
for room (an estimate was short) lets go of the shared prompt and is later
prefilled again on its own copy; a group paused for a better class goes
back to the queue whole (``worker.engine.preempt``).

A requeued group (``shared.requeue``) runs only its open choices (those
not finished), the leader being the first of them. Until the fork the
leader's output is empty (it feeds the prompt only); at the fork every
sample, the leader too, takes the tokens its choice already emitted
(``take_emitted``): a sample without any samples its first token from the
prompt's last logits as usual; one with some is prefilled on top of the
shared prompt (cached offset = prompt length) before it samples on, as a
resumed single request is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from shared.request_log import now_ms
from shared.schemas import FinishReason, GenerateRequest
from worker.engine.radix_cache import Lease


def member_seed(seed: int | None, choice: int) -> int | None:
    """Sample ``choice``'s seed: the request's own for choice 0 (so n=1 is unchanged),
    a distinct derived one for the others, so a seeded group is reproducible."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)


def sample_msg(msg: GenerateRequest, choice: int) -> GenerateRequest:
    """The message sample ``choice`` of the group ``msg`` runs with: its own seed.

    Seeds after a requeue: as for a resumed single request, which keeps its seed,
    each sample keeps its choice's seed, whichever sample leads; the sampler keys
    a seeded row's noise by (seed, output index) and a resumed sample samples
    index len(emitted) next, so it continues its uninterrupted random stream.
    """
    if choice == 0:
        return msg
    return msg.model_copy(
        update={"params": msg.params.model_copy(update={"seed": member_seed(msg.params.seed, choice)})}
    )


@dataclass(eq=False)
class Group:
    """What a group's samples share on this worker."""

    msg: GenerateRequest  # as it arrived (choice 0's seed): members derive theirs from it
    size: int
    live: int  # samples not ended yet (the unforked leader stands for all): the inbox entry goes with the last
    forked: bool = False
    # Its members are in the engine's lists (``Engine._join_forks``, under the engine's lock). The
    # runner forks before the prefill's forward and the engine lists the members after it: until
    # then the leader still stands for every sample in the load the heartbeat thread publishes
    # (``counted_group``), or a record built in between shows the group as its leader alone.
    joined: bool = False
    prompt_slots: np.ndarray | None = None  # the leader's prompt slots, from the fork on
    holders: int = 0  # members whose table rows point at prompt_slots
    lease: Lease | None = None  # the prefix cache's hold on the prompt's cached part (worker.engine.kv_slots)
    # choice -> output of the samples that ended here: a paused group goes back with them finished
    # (``worker.engine.preempt.handed_back``), never to run again.
    ended: dict[int, list[int]] = field(default_factory=dict)


class Phase(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class GrammarStep(Enum):
    """What a landed token did to its sample's grammar (``worker.runner.grammar.Grammars.accept``)."""

    OPEN = "open"  # more to come (or no grammar)
    ENDED = "ended"  # the grammar is done: the output ends with this token
    STUCK = "stuck"  # no token was allowed and the grammar is not complete: it cannot be met


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
    # slot_ids[:num_locked] are the prefix cache's, held through ``lease`` (worker.engine.kv_slots).
    lease: Lease | None = None
    num_locked: int = 0
    # Set once the whole prompt (plus resumed output) is in the pool and a token
    # was sampled from it; from then on the request feeds one token a step.
    is_prefilled: bool = False
    # Paused (its slots taken back) and waiting to be prefilled again: its Started
    # event was already sent, so re-admission must not send another.
    is_paused: bool = False
    finish_reason: FinishReason | None = None
    # Set by the runner when this sample's grammar (msg.params.constraint) has ended its output.
    is_grammar_complete: bool = False
    # Asked-for prompt logprobs gathered chunk by chunk (worker.runner.prompt_logprobs), until the
    # first token takes them to the publisher.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    choice: int = 0  # which sample of its request (always 0 unless a group)
    group: Group | None = None  # None for n = 1
    num_shared: int = 0  # leading positions whose slots are group.prompt_slots (not ours to free)
    taken_ms: int = field(default_factory=now_ms)  # read from the inbox (Unix ms), for the status hash
    epoch: int = 0  # its dispatch's fencing token (shared.request_log), which the publisher writes with

    def __post_init__(self) -> None:
        # A request dispatched again continues after the tokens already emitted; a group's samples
        # take theirs at the fork (take_emitted).
        self.output_ids = list(self.msg.resume_ids)
        if self.msg.n > 1 and self.group is None:  # a group's leader, as it arrives
            self.group = Group(msg=self.msg, size=self.msg.n, live=1)
            self.choice = self.msg.open_choices[0]
            self.msg = sample_msg(self.msg, self.choice)

    @property
    def is_suspect(self) -> bool:
        """A worker died while it ran there, and the death was counted against it (``attempt``): it
        prefills alone (``worker.engine.admission``)."""
        return self.msg.attempt > 0

    @property
    def unforked_group(self) -> Group | None:
        """The group this request still stands for whole (as its leader, before the fork), else None."""
        return self.group if self.group is not None and not self.group.forked else None

    @property
    def counted_group(self) -> Group | None:
        """The group this request stands for whole in a load summary (``worker.engine.load``): as
        ``unforked_group``, and on until its members are listed beside it (``Group.joined``)."""
        return self.group if self.group is not None and not self.group.joined else None

    @property
    def is_unforked_leader(self) -> bool:
        return self.unforked_group is not None

    def fork_members(self) -> list[Req]:
        """The group's other open samples, each with its own params (derived seed) and no slots yet."""
        group = self.unforked_group
        assert group is not None, "only an unforked group's leader forks"
        return [
            Req(msg=sample_msg(group.msg, c), inbox_id=self.inbox_id, choice=c, group=group, epoch=self.epoch)
            for c in group.msg.open_choices
            if c != self.choice
        ]

    def take_emitted(self) -> None:
        """At the fork: this sample continues after the tokens its choice already emitted."""
        assert self.group is not None, "only a group's samples fork"
        self.output_ids = list(self.group.msg.emitted(self.choice))

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

    def can_preempt(self, max_preemptions: int) -> bool:
        """Whether a better class may pause it (``worker.engine.preempt``): not one paused for a
        better class ``max_preemptions`` times already. A group's sample may be, with every other
        sample of its group (``by_request``): they share the prompt's slots and one inbox entry, and
        go back as one message. Prompt logprobs do not stand in the way: they go out with the first
        token, so a request paused before it sent nothing and scores its prompt on resume, and one
        paused after it resumes with output, which never scores it again
        (``worker.runner.prompt_logprobs.wants_prompt_logprobs``)."""
        return self.phase is not Phase.FINISHED and self.msg.preemptions < max_preemptions


def by_request(reqs: Iterable[Req]) -> list[list[Req]]:
    """``reqs`` by request, in the order each request is first met: a group's samples together
    (what a pause takes out at once), every other request alone."""
    units: dict[int, list[Req]] = {}
    for req in reqs:
        units.setdefault(id(req.group) if req.group is not None else id(req), []).append(req)
    return list(units.values())


def sampling_after_prefill(completing: list[Req], forks: dict[Req, list[Req]]) -> list[tuple[Req, Req]]:
    """(whose last logits, sample) for every sample that samples after a prefill step, in order:
    each completing request from its own logits, a fork's members right after their leader, from
    the leader's. Only samples with nothing left uncached sample: one the fork gave emitted tokens
    (a requeued group) has them prefilled first. Call after the step's prefill and fork."""
    return [(req, r) for req in completing for r in [req, *forks.get(req, [])] if r.num_uncached == 0]
