"""A step's forwards, from launch to landing: the part of the engine that turns running requests into tokens.

A step (``worker.engine.engine``) decodes one token for every prefilled request but those whose
token in flight is its last (``_decoding``: with ``overlap`` its length is known without it, so
an end known in advance costs nothing), and prefills prompt chunks (``_launch_prefill``); the
chunk that completes a group's prompt forks the group's other samples, which run from then on
(``_join_forks``). A forward's tokens land when the engine needs them (``_land``; ``flush``,
the decode in flight): they advance their samples' grammars, are appended to their requests and
leave as one ``Tokens`` record, and a request they end (EOS, ``max_new_tokens``, a complete
grammar) is released at once (``_release``: its slots freed; the inbox entry with a group's
last sample). A token its grammar did not allow ends its sample failed, never published
(``STUCK_ERROR``). The rows of requests that ended before their tokens landed (an end found a
step late with ``overlap``; a cancel, stop string or preemption between steps) are dropped:
nothing was published for them (``num_discarded``). The requests of the forwards under way are
those a step that raised is blamed on (``suspects``).

``Forwards`` is a part of ``worker.engine.engine.Engine``, whose class derives from it: the
state it reads and changes is the engine's, set in ``Engine.__init__``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.schemas import Constraint, FinishReason, RequestStatus
from worker.engine.events import Ended, Event, Released, Tokens
from worker.engine.request import GrammarStep, Phase, Req, sampling_after_prefill

if TYPE_CHECKING:  # the engine itself stays free of torch
    from worker.runner.sampler import PendingSampled, Sampled

# Why a sample whose grammar allowed no next token ended (a schema whose parts contradict: xgrammar
# compiles it, and the mask of some state is empty); the client's 400 (``Constraint.INVALID``).
STUCK_ERROR = "no token can follow the output so far under the constraint: it cannot be met (do its parts contradict?)"


class Launcher(Protocol):
    """What a step's forwards ask of the runner (``worker.engine.engine.Runner`` asks the rest): the
    prefill, queued on the device, the grammar step of each landed token, and a request freed."""

    def prefill(
        self, reqs: list[Req], num_new: list[int], completing: list[Req], forks: dict[Req, list[Req]] | None = None
    ) -> PendingSampled: ...
    def accept(self, reqs: list[Req], ids: list[int]) -> list[GrammarStep]: ...
    def finish(self, req: Req) -> None: ...


@dataclass(frozen=True)
class Launched:
    """Samples whose tokens are on their way from the device, in the order they were sampled."""

    reqs: list[Req]
    pending: PendingSampled


class Forwards:
    """A step's forwards and their landing (module docstring), on the engine's state, declared here."""

    runner: Launcher
    eos_ids: set[int]
    waiting: deque[Req]
    running: list[Req]
    num_discarded: int
    _in_flight: Launched | None
    _prefilling: list[Req]
    _decoding_now: list[Req]
    _lock: threading.Lock

    def suspects(self) -> list[Req]:
        """The requests of the forwards under way: after a step raised, the ones it is blamed on (a
        prefill's batch, or the decoding batch: the worker can tell no closer), whom a death counts
        against (``shared.requeue``)."""
        flying = self._in_flight.reqs if self._in_flight is not None else []
        return [*self._prefilling, *self._decoding_now, *flying]

    def flush(self) -> list[Event]:
        """Land the decode in flight, if any: its tokens, and the ends they make."""
        launched, self._in_flight = self._in_flight, None
        return self._land(launched) if launched is not None else []

    def _decoding(self) -> list[Req]:
        """The prefilled requests that feed a token this step: all but those whose token in flight
        is their last (their length is known without it)."""
        if self._in_flight is None:
            return [r for r in self.running if r.is_prefilled]
        flying = set(self._in_flight.reqs)
        return [
            r
            for r in self.running
            if r.is_prefilled and not (r in flying and len(r.output_ids) + 1 >= r.msg.params.max_new_tokens)
        ]

    def _launch_prefill(self, chunks: list[tuple[Req, int]]) -> Launched:
        """One prefill forward over (request, tokens) chunks; those that complete sample."""
        reqs = [r for r, _ in chunks]
        completing = [r for r, n in chunks if n == r.num_uncached]
        forks = {r: r.fork_members() for r in completing if r.is_unforked_leader}
        pending = self.runner.prefill(reqs, [n for _, n in chunks], completing, forks)
        self._join_forks(forks)
        return Launched([r for _, r in sampling_after_prefill(completing, forks)], pending)

    def _join_forks(self, forks: dict[Req, list[Req]]) -> None:
        """A forked group's new samples run from now on (the runner gave them rows and the prompt)."""
        with self._lock:
            for leader, members in forks.items():
                assert leader.group is not None, "only a group's leader forks"
                leader.group.live += len(members)
                leader.group.joined = True  # from now on each sample counts itself (Req.counted_group)
                for member in members:
                    member.phase = Phase.RUNNING
                    self.running.append(member)

    def _land(self, launched: Launched) -> list[Event]:
        """Wait for ``launched``'s tokens; those of requests that ended meanwhile (found a step late,
        cancelled, stopped, preempted) are dropped: nothing was published for them."""
        if not launched.reqs:
            return []
        reqs, sampled = self._live(launched.reqs, launched.pending.result())
        events: list[Event] = []
        for req, step in zip(reqs, self.runner.accept(reqs, sampled.ids)):
            req.is_grammar_complete = step is GrammarStep.ENDED
            if step is GrammarStep.STUCK:  # its token was outside the grammar: never published
                events += self._fail_running(req, f"{Constraint.INVALID}: {STUCK_ERROR}")
        if events:
            reqs, sampled = self._live(reqs, sampled, discarded=False)
        return events + self._sample_and_finish(reqs, sampled)

    def _live(self, reqs: list[Req], sampled: Sampled, discarded: bool = True) -> tuple[list[Req], Sampled]:
        """The rows of requests that have not finished (``discarded``: count the others' tokens)."""
        if all(r.phase is not Phase.FINISHED for r in reqs):
            return reqs, sampled
        live = [row for row, r in enumerate(reqs) if r.phase is not Phase.FINISHED]
        if discarded:
            self.num_discarded += len(reqs) - len(live)
        return [reqs[row] for row in live], sampled._replace(
            ids=[sampled.ids[row] for row in live],
            logprobs=[sampled.logprobs[row] for row in live],
            top=[sampled.top[row] for row in live],
        )

    def _fail_running(self, req: Req, error: str) -> list[Event]:
        """End running sample ``req`` with ``error`` after the tokens it emitted."""
        ended = Ended(
            req.id, RequestStatus.FAILED, "error", len(req.output_ids), error, choice=req.choice, epoch=req.epoch
        )
        return [ended, *self._release(req, "error")]

    def _sample_and_finish(self, reqs: list[Req], sampled: Sampled) -> list[Event]:
        """The forward's tokens as one ``Tokens`` record (columns, no object per token), then
        the releases of the requests they finished (after it: the publisher writes in order)."""
        if not reqs:
            return []
        indexes: list[int] = []
        reasons: dict[int, FinishReason] = {}
        for row, (req, token_id) in enumerate(zip(reqs, sampled.ids)):
            req.is_prefilled = True
            req.output_ids.append(token_id)
            indexes.append(len(req.output_ids) - 1)
            reason = self._finish_reason(req, token_id)
            if reason is not None:
                reasons[row] = reason
        tops = {row: top for row, top in enumerate(sampled.top) if top is not None}
        prompts = {row: r.prompt_logprobs for row, r in enumerate(reqs) if r.prompt_logprobs is not None}
        for row in prompts:  # they leave with the first token (worker.runner.prompt_logprobs)
            reqs[row].prompt_logprobs = None
        tokens = Tokens(
            [r.id for r in reqs],
            [r.choice for r in reqs],
            indexes,
            sampled.ids,
            sampled.logprobs,
            reasons,
            tops,
            prompts,
        )
        events: list[Event] = [tokens]
        for row, reason in reasons.items():
            events += self._release(reqs[row], reason)
        return events

    def _finish_reason(self, req: Req, token_id: int) -> FinishReason | None:
        if req.is_grammar_complete or (token_id in self.eos_ids and not req.msg.params.ignore_eos):
            return "stop"
        if req.is_done_generating:
            return "length"
        return None

    def _take_out(self, req: Req) -> None:
        """``req`` out of the running batch (its row and slots freed) or the waiting queue, finished.
        The caller holds ``_lock``."""
        if req.phase is Phase.RUNNING:
            self.running.remove(req)
            self.runner.finish(req)
        else:
            self.waiting.remove(req)
        req.phase = Phase.FINISHED

    def _release(self, req: Req, reason: FinishReason) -> list[Event]:
        """Free ``req``; its inbox entry goes when it was its group's last live sample."""
        with self._lock:
            self._take_out(req)
            req.finish_reason = reason
        if req.group is not None:
            req.group.ended[req.choice] = req.output_ids  # a pause of the others leaves it finished
            req.group.live -= 1
            if req.group.live > 0:
                return []
        return [Released(req.id, req.inbox_id)]
