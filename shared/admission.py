"""One admission rule, built the same way by the router (per worker record)
and by each worker (its own waiting queue): a policy, its margin, and the
output-length history past-future estimates from."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shared.config import AdmissionSettings
from shared.history import Estimator, OutputLengthHistory
from shared.peak import ReqState, check, group_states
from shared.schemas import GenerateRequest


def request_state(request: GenerateRequest) -> ReqState:
    """A request about to be dispatched; a resumed one has its emitted tokens already."""
    done = len(request.resume_ids)
    return ReqState(request.num_prompt_tokens + done, done, request.params.max_new_tokens,
                    int(request.params.ignore_eos))


def request_states(request: GenerateRequest) -> tuple[ReqState, ...]:
    """What a request adds to a worker: its state, or a group's open samples (the prompt counted once),
    each with the tokens it emitted before a requeue."""
    if request.n > 1:
        return tuple(group_states(request.num_prompt_tokens, [len(request.emitted(c)) for c in request.open_choices],
                                  request.params.max_new_tokens, int(request.params.ignore_eos)))
    return (request_state(request),)


class AdmissionRule:
    def __init__(self, settings: AdmissionSettings):
        self.settings = settings
        self.history = OutputLengthHistory(settings.history_window, settings.history_prior)
        self.estimator = Estimator(self.history, settings.admission_quantile, settings.admission_seed)

    @property
    def policy(self) -> str:
        return self.settings.admission

    @property
    def margin(self) -> float:
        return self.settings.admission_margin

    def learn(self, newest_first: Iterable[int | str]) -> None:
        """Replace the window with the newest finished output lengths (from Redis)."""
        self.history.update(newest_first)

    def fits(self, states: Sequence[ReqState], candidate: ReqState | Sequence[ReqState], max_total_tokens: int,
             max_requests: int | None) -> bool:
        return check(states, candidate, max_total_tokens, max_requests, self.policy, self.estimator,
                     self.margin) is not None
