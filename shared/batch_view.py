"""The admission checker: a batch prepared once, asked about many candidates.

Both the router (one view per worker record, ``router.admission.worker_view``) and the
worker (one view per admission pass over its own waiting queue,
``worker.engine.engine``) ask a ``BatchView`` whether a candidate fits: a
request's state, or a group's samples' states with its prompt counted once.
A ``Policy`` (``shared.admission``) says how to project the batch's use;
the view keeps that projection as a ``Tally`` that answers for one more
candidate without starting over:

- ``SumTally`` (conservative, aggressive): the sum of each state's need; a
  candidate costs O(1).
- ``PeakTally`` (past_future: K draws; past_future_quantile: one): per
  draw of the remaining lengths, the batch's (held, remaining) pairs kept
  sorted (``shared.peak.SortedPeak``); a candidate costs O(K log n), a
  group O(K n log n).

``shared.peak.check`` computes the same answers from scratch, for every
candidate: O(K n log n) each, which was nearly all of the router's time at
32 workers, and 0.6 s for a worker's burst of 1,000 requests. The answers
are ``check``'s: exactly for the sums and the quantile; for past_future the
same computation over draws made once per view instead of once per call
(both seeded, so a blocked head of line gets the same answer until
something changes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shared.peak import Projection, ReqState, SortedPeak, num_draws, peak_tokens

MAX_DRAWS = num_draws(0)  # K for an empty batch: the most a check ever takes


class Candidate:
    """A request about to be placed: its states and, per draw, each state's remaining length,
    drawn once for every view it is asked of (``lengths[k][j]``: draw k, state j)."""

    def __init__(self, states: Sequence[ReqState], policy: Policy, lengths: list[list[int]] | None = None):
        self.states = tuple(states)
        self.lengths = policy.lengths(self.states) if lengths is None else lengths  # given: ``less``'s
        self.policy = policy
        self._less: dict[int, Candidate] = {}  # held -> the candidate less that (``less``)

    def __len__(self) -> int:
        return len(self.states)

    def less(self, held: int) -> Candidate:
        """The candidate with ``held`` of its first state's tokens (a group's: its prompt's) already
        counted on the pool, by the running requests that hold a cached prefix it starts with: what
        it adds there (the worker's own ``Admission.adds``). The same draws: a remaining length never
        depends on the tokens held. One object per ``held``, so a view that was just asked about it
        takes its answer on ``admit``."""
        if held <= 0:
            return self
        if held not in self._less:
            first = self.states[0]
            states = (first._replace(held=max(0, first.held - held)), *self.states[1:])
            self._less[held] = Candidate(states, self.policy, self.lengths)
        return self._less[held]


class Tally(Protocol):
    """A batch's projected use, kept up to date as states join it."""

    def use(self) -> int: ...
    def use_with(self, candidate: Candidate) -> int: ...
    def add(self, states: Sequence[ReqState], lengths: Sequence[Sequence[int]] = ()) -> None: ...
    def admit(self, candidate: Candidate) -> None: ...


class Policy(Projection, Protocol):
    """An admission policy: ``use`` and ``limit`` from scratch (``shared.peak.Projection``),
    and the prepared form the view keeps. One class per policy, in ``shared.admission``."""

    name: str

    def tally(self, states: Sequence[ReqState]) -> Tally:
        """``states`` prepared for many questions."""
        ...

    def lengths(self, states: Sequence[ReqState]) -> list[list[int]]:
        """A candidate's remaining lengths per draw ([] when the policy draws none)."""
        ...


class SumTally:
    """A sum of one need per state: conservative (prompt + max_new_tokens), aggressive (held now)."""

    def __init__(self, states: Sequence[ReqState], need: Callable[[ReqState], int]):
        self.need = need
        self.total = sum(map(need, states))

    def use(self) -> int:
        return self.total

    def use_with(self, candidate: Candidate) -> int:
        return self.total + sum(map(self.need, candidate.states))

    def add(self, states: Sequence[ReqState], lengths: Sequence[Sequence[int]] = ()) -> None:
        self.total += sum(map(self.need, states))

    def admit(self, candidate: Candidate) -> None:
        self.add(candidate.states)


class PeakTally:
    """The past-future peak per draw of the remaining lengths, each draw a ``SortedPeak``.

    Invariant: ``draws`` holds ``num_draws(count)`` draws of every counted state; K only
    shrinks as the batch grows, so a question reads all of them (a group's reads the first
    ``num_draws(count + len(group) - 1)``: K follows the batch without the candidate, as
    in the paper and in ``check``).
    """

    def __init__(self, states: Sequence[ReqState], remaining: Callable[[ReqState], int], draws: Callable[[int], int]):
        self.remaining = remaining  # a state's length for one draw, when it comes without its own
        self.num_draws = draws
        self.count = len(states)
        self.draws = [SortedPeak((s.held, remaining(s)) for s in states) for _ in range(draws(len(states)))]
        self._use: int | None = None  # use() until the next add
        self._asked: tuple[Candidate, list[int]] | None = None  # the last candidate's peak per draw

    def use(self) -> int:
        if self._use is None:
            self._use = max(draw.peak() for draw in self.draws)
        return self._use

    def use_with(self, candidate: Candidate) -> int:
        draws = self.draws[: self.num_draws(self.count + len(candidate) - 1)]
        if len(candidate) == 1:
            held = candidate.states[0].held
            peaks = [draw.peak_with(held, lengths[0]) for draw, lengths in zip(draws, candidate.lengths)]
        else:
            helds = [s.held for s in candidate.states]
            peaks = [draw.peak_with_all(list(zip(helds, lengths))) for draw, lengths in zip(draws, candidate.lengths)]
        self._asked = (candidate, peaks)
        return max(peaks)

    def add(self, states: Sequence[ReqState], lengths: Sequence[Sequence[int]] = ()) -> None:
        """``states`` join, one at a time, with ``lengths[k][j]`` for draw k (else drawn here)."""
        self._use, self._asked = None, None
        for j, state in enumerate(states):
            self.count += 1
            del self.draws[self.num_draws(self.count) :]
            for k, draw in enumerate(self.draws):
                draw.add(state.held, lengths[k][j] if lengths else self.remaining(state))

    def admit(self, candidate: Candidate) -> None:
        """If the candidate was just asked about, its peaks are the use from now on (no rebuild)."""
        asked = self._asked[1] if self._asked is not None and self._asked[0] is candidate else None
        self.add(candidate.states, candidate.lengths)
        if asked is not None:
            self._use = max(asked[: len(self.draws)])


class BatchView:
    """The requests on one pool, ready to answer ``ratio(candidate)``; ``added`` counts the
    states that joined since it was built."""

    def __init__(self, states: Sequence[ReqState], max_total_tokens: int, max_requests: int | None, policy: Policy):
        self.max_total_tokens = max_total_tokens
        self.max_requests = max_requests
        self.policy = policy
        self.limit = policy.limit(max_total_tokens)
        self.tally = policy.tally(states)
        self.count = len(states)
        self.added = 0

    def use(self) -> int:
        """The projected use without a candidate: what orders workers, least loaded first."""
        return self.tally.use()

    def add(self, states: Sequence[ReqState]) -> None:
        """Requests that now count against this pool (dispatched, or seen in an inbox), their
        lengths drawn here."""
        self.count += len(states)
        self.added += len(states)
        self.tally.add(states)

    def admit(self, candidate: Candidate) -> None:
        """``add`` the candidate with its own draws (what ``ratio`` just weighed)."""
        self.count += len(candidate)
        self.added += len(candidate)
        self.tally.admit(candidate)

    def fits_alone(self, candidate: Candidate) -> bool:
        """Whether the candidate would fit this pool with nothing else on it (its own draws; O(K))."""
        if not candidate.lengths:  # a sum: no draws, and the policy's use needs none
            return self.policy.use(candidate.states) <= self.limit
        return all(
            peak_tokens(zip((s.held for s in candidate.states), lengths)) <= self.limit
            for lengths in candidate.lengths[: num_draws(len(candidate) - 1)]
        )

    def ratio(self, candidate: Candidate) -> float | None:
        """Use / pool with the candidate, or None if it does not fit (``check``'s answer)."""
        if self.max_requests is not None and self.count + len(candidate) > self.max_requests:
            return None
        use = self.tally.use_with(candidate)
        return use / self.max_total_tokens if use <= self.limit else None
