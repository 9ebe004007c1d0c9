"""The admission policies, and the rule router and worker build the same way from the settings.

A batch's requests (running and waiting, plus what is on its way) and a
candidate must fit the pool by the chosen policy (``--admission``), and
their count ``running_max_req_size``; ``shared.batch_view.BatchView`` asks
the policy, lengths come from ``shared.history``:

| policy                 | projected use                               | limit        |
|------------------------|---------------------------------------------|--------------|
| ``Conservative``       | sum of prompt + max_new_tokens (TGI's)      | pool         |
| ``Aggressive``         | sum of tokens held now (relies on pausing)  | pool * 0.95  |
| ``PastFuture``         | worst peak over K Monte-Carlo length draws  | pool * (1-m) |
| ``PastFutureQuantile`` | peak with every length at quantile q        | pool * (1-m) |

The router checks a worker's published record, which lags by up to a
heartbeat; that is safe for the peak: requests that finished since only made
the record pessimistic, and a peak taken at the record's instant bounds
every later step of the same batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from shared.batch_view import MAX_DRAWS, PeakTally, Policy, SumTally
from shared.config import AdmissionSettings, PolicyName
from shared.history import Estimator, OutputLengthHistory
from shared.peak import ReqState, group_states, num_draws
from shared.schemas import GenerateRequest

AGGRESSIVE_WATERMARK = 0.95


def request_state(request: GenerateRequest) -> ReqState:
    """A request about to be dispatched; a resumed one has its emitted tokens already."""
    done = len(request.resume_ids)
    return ReqState(
        request.num_prompt_tokens + done, done, request.params.max_new_tokens, int(request.params.ignore_eos)
    )


def request_states(request: GenerateRequest) -> tuple[ReqState, ...]:
    """What a request adds to a worker: its state, or a group's open samples (the prompt counted once),
    each with the tokens it emitted before a requeue."""
    if request.n > 1:
        return tuple(
            group_states(
                request.num_prompt_tokens,
                [len(request.emitted(c)) for c in request.open_choices],
                request.params.max_new_tokens,
                int(request.params.ignore_eos),
            )
        )
    return (request_state(request),)


class _Summed:
    """A policy that sums one need per request (``need``, ``limit``: the subclass's)."""

    def need(self, state: ReqState) -> int:
        raise NotImplementedError

    def use(self, states: Sequence[ReqState]) -> int:
        return sum(map(self.need, states))

    def tally(self, states: Sequence[ReqState]) -> SumTally:
        return SumTally(states, self.need)

    def lengths(self, states: Sequence[ReqState]) -> list[list[int]]:
        return []  # a sum: no lengths to estimate


class Conservative(_Summed):
    """TGI's: every request may run to max_new_tokens, so the pool can never run out. An exact
    upper bound needs no margin."""

    name = "conservative"

    def need(self, state: ReqState) -> int:
        return state.conservative_need

    def limit(self, max_total_tokens: int) -> float:
        return max_total_tokens


class Aggressive(_Summed):
    """What the requests hold now, under a watermark; an overflow is left to pausing."""

    name = "aggressive"

    def need(self, state: ReqState) -> int:
        return state.held

    def limit(self, max_total_tokens: int) -> float:
        return max_total_tokens * AGGRESSIVE_WATERMARK


class _Peaked:
    """A policy that takes the peak formula over estimated remaining lengths (``shared.history``),
    within the pool less ``margin``."""

    def __init__(self, estimator: Estimator, margin: float):
        self.estimator = estimator
        self.margin = margin

    def limit(self, max_total_tokens: int) -> float:
        return max_total_tokens * (1 - self.margin)


class PastFuture(_Peaked):
    """The Past-Future paper's: the worst peak over K Monte-Carlo draws of every remaining length."""

    name = "past_future"

    def use(self, states: Sequence[ReqState]) -> int:
        return self.estimator.peak_sampled(states)

    def tally(self, states: Sequence[ReqState]) -> PeakTally:
        self.estimator.restart()  # a view of the same batch draws the same lengths
        return PeakTally(states, self.estimator.remaining_sampled, num_draws)

    def lengths(self, states: Sequence[ReqState]) -> list[list[int]]:
        self.estimator.restart()  # the same request gets the same draws on every retry
        return [[self.estimator.remaining_sampled(s) for s in states] for _ in range(MAX_DRAWS)]


class PastFutureQuantile(_Peaked):
    """The peak with every unknown length at quantile q of its conditional distribution: one
    deterministic draw."""

    name = "past_future_quantile"

    def use(self, states: Sequence[ReqState]) -> int:
        return self.estimator.peak_quantile(states)

    def tally(self, states: Sequence[ReqState]) -> PeakTally:
        return PeakTally(states, self.estimator.remaining_quantile, lambda batch_size: 1)

    def lengths(self, states: Sequence[ReqState]) -> list[list[int]]:
        return [[self.estimator.remaining_quantile(s) for s in states]]


# --admission's choices (shared.config.PolicyName), each built from the estimator and the margin.
POLICIES: dict[PolicyName, Callable[[Estimator, float], Policy]] = {
    "conservative": lambda estimator, margin: Conservative(),
    "aggressive": lambda estimator, margin: Aggressive(),
    "past_future": PastFuture,
    "past_future_quantile": PastFutureQuantile,
}


class AdmissionRule:
    """A policy and the output-length history it estimates from, built the same way by the
    router (per worker record) and by each worker (its own waiting queue)."""

    def __init__(self, settings: AdmissionSettings):
        self.settings = settings
        self.history = OutputLengthHistory(settings.history_window, settings.history_prior)
        self.estimator = Estimator(self.history, settings.admission_quantile, settings.admission_seed)
        self.policy = POLICIES[settings.admission](self.estimator, settings.admission_margin)

    def learn(self, newest_first: Iterable[int | str]) -> None:
        """Replace the window with the newest finished output lengths (from Redis)."""
        self.history.update(newest_first)
