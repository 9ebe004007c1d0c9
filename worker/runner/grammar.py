"""Constrained decoding through xgrammar: JSON, JSON schema, regex and EBNF grammars.

A request whose ``SamplingParams.constraint`` is set gets one
``GrammarMatcher`` for as long as it holds a table row (``start`` ..
``finish``). Its state is a function of the output tokens alone, so a
matcher is always built by replaying ``req.output_ids``: a requeued request
(its ``resume_ids``), a paused one prefilled again and a group's sample
forked after its emitted tokens all continue exactly where the grammar was.

Each step, ``mask`` fills one row of a host bitmask per constrained sample
(the batch's other rows are not touched: ``indices``), on xgrammar's thread
pool (``BatchGrammarMatcher``), after the forward is launched, so on a GPU
the CPU work overlaps the forward; the sampler applies it to the logits in
one batched call (``apply_token_bitmask_inplace`` on the logits' device).
After sampling, ``accept`` advances every matcher; a matcher that has
terminated (the grammar was complete and a stop token was taken) ends its
request with ``stop``.

Compiled grammars depend on the tokenizer and the constraint only: they are
kept in a bounded LRU (``worker.runner.grammar_cache.GrammarCache``), so a
schema sent with every request compiles once per worker. Compiles run off
the model loop, in processes of their own, one per constraint however many
requests send it: the engine asks ``prepare`` before it admits a waiting
request, and one whose grammar is not compiled yet stays waiting in its
place (``held``; still load, still cancellable, handed back by a drain)
while the requests around it run. The service ends a held request whose
constraint failed to compile, or did not within ``compile_timeout_s``
(``failures``), with an error the producer answers as a 400
(``Constraint.error_code``); a compile no held request waits for any more
is stopped. A compiled grammar stays while a matcher uses it, whatever the
LRU drops, so a group's forked samples never compile on the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from shared.schemas import Constraint
from worker.engine.request import GrammarStep, Phase, Req
from worker.runner.grammar_cache import CompileFailed, GrammarCache

log = logging.getLogger("lightq.worker")

COMPILE_TIMEOUT_S = 30.0  # the default of --grammar_compile_timeout_s


@dataclass(frozen=True)
class GrammarMask:
    """One step's mask: ``bitmask`` [B, ceil(V / 32)] int32 on the host, bit set = allowed;
    only the ``rows`` listed are constrained (the others are left as they were)."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of ``logits`` [B, V] with every disallowed token at -inf (one batched op)."""
        masked = logits.clone()
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(masked, bitmask, indices=self.rows)
        return masked


class Grammars:
    """The matchers of the samples that hold a table row and have a constraint, and the waiting
    requests held until their constraint compiles."""

    def __init__(
        self,
        cache: GrammarCache,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.compile_timeout_s = compile_timeout_s
        self._clock = clock
        self.matchers: dict[Req, xgr.GrammarMatcher] = {}
        # Per constraint, its compiled grammar and how many matchers use it (kept out of the LRU's reach).
        self._in_use: dict[Constraint, tuple[xgr.CompiledGrammar, int]] = {}
        self.held: dict[Req, float] = {}  # waiting for their grammar -> since when (clock)
        self._bitmask = xgr.allocate_token_bitmask(1, cache.vocab_size)
        self._filler = xgr.BatchGrammarMatcher(max_threads="auto")  # a row per thread, ~50 us a row

    @property
    def num_held(self) -> int:
        return len(self.held)

    def prepare(self, req: Req) -> bool:
        """Whether ``req`` can start now; if not, its grammar is compiling (submitted here) and it is
        held. Never waits (the engine asks before admitting, on the model loop)."""
        constraint = req.msg.params.constraint
        if constraint is None:
            return True
        if constraint in self._in_use or isinstance(self.cache.status(constraint), xgr.CompiledGrammar):
            self.held.pop(req, None)
            return True
        self.cache.submit(constraint)
        self.held.setdefault(req, self._clock())
        return False

    def failures(self) -> list[tuple[Req, str]]:
        """Held requests to end now, with why: their constraint failed to compile, or took longer
        than ``compile_timeout_s``. Held requests that compiled or ended meanwhile (cancelled,
        handed back) are let go. A compile that no held request waits for any more is stopped."""
        now, failed, released = self._clock(), [], set()
        for req, since in list(self.held.items()):
            constraint = req.msg.params.constraint
            assert constraint is not None, "only constrained requests are held"
            status = self.cache.status(constraint) if req.phase is Phase.WAITING else None
            if isinstance(status, CompileFailed):
                failed.append((req, status.message))
            elif status is None and req.phase is Phase.WAITING:
                if now - since <= self.compile_timeout_s:
                    continue  # still compiling
                failed.append((req, self._too_costly(constraint)))
            del self.held[req]
            released.add(constraint)
        for constraint in released - {r.msg.params.constraint for r in self.held}:
            self.cache.cancel(constraint)  # compiled or failed: nothing to stop
        return failed

    def _too_costly(self, constraint: Constraint) -> str:
        return (
            f"{Constraint.TOO_COSTLY}: the {constraint.kind} constraint was not compiled within "
            f"{self.compile_timeout_s:g} s on the worker; ask for less (fewer properties or "
            f"alternatives, less nesting, smaller counted repetitions) or retry later"
        )

    def wait(self, timeout: float) -> None:
        """Until a compile finishes, at most ``timeout`` seconds: the loop's wait when only held
        requests are left."""
        self.cache.wait(timeout)

    def start(self, req: Req) -> None:
        """A matcher for ``req`` (none without a constraint), after its output so far. Its grammar is
        compiled (``prepare`` said so) or used by a running sample already (a group's fork)."""
        self.finish(req)
        constraint = req.msg.params.constraint
        if constraint is None:
            return
        grammar, users = self._in_use.get(constraint, (None, 0))
        if grammar is None:
            grammar = self.cache.get(constraint)  # waits only when nobody asked ``prepare``: tests
        self._in_use[constraint] = (grammar, users + 1)
        matcher = xgr.GrammarMatcher(grammar)
        for n, token_id in enumerate(req.output_ids):
            if not matcher.accept_token(token_id):
                # Cannot happen with the grammar the tokens were sampled under; the rest of the
                # output is then unconstrained from the last accepted state, which is logged.
                log.warning("%s: emitted token %d (index %d) rejected on replay", req.id, token_id, n)
                break
        self.matchers[req] = matcher

    def finish(self, req: Req) -> None:
        if self.matchers.pop(req, None) is None:
            return
        constraint = req.msg.params.constraint
        assert constraint is not None, "only constrained samples have matchers"
        grammar, users = self._in_use[constraint]
        if users > 1:
            self._in_use[constraint] = (grammar, users - 1)
        else:
            del self._in_use[constraint]

    def mask(self, reqs: Sequence[Req]) -> GrammarMask | None:
        """The next token's mask for ``reqs`` (a batch's samples in order), None when none is constrained."""
        rows = [i for i, r in enumerate(reqs) if r in self.matchers]
        if not rows:
            return None
        if self._bitmask.shape[0] < len(reqs):
            size = max(len(reqs), 2 * self._bitmask.shape[0])
            self._bitmask = xgr.allocate_token_bitmask(size, self.cache.vocab_size)
        bitmask = self._bitmask[: len(reqs)]
        self._filler.batch_fill_next_token_bitmask([self.matchers[reqs[i]] for i in rows], bitmask, rows)
        return GrammarMask(bitmask, rows)

    def accept(self, reqs: Sequence[Req], ids: Sequence[int]) -> list[GrammarStep]:
        """Advance each constrained sample's matcher by its sampled token; per row, whether the
        grammar goes on, has ended the output (complete, and a stop token taken) or is stuck."""
        steps = [GrammarStep.OPEN] * len(reqs)
        for i, (req, token_id) in enumerate(zip(reqs, ids)):
            matcher = self.matchers.get(req)
            if matcher is None:
                continue
            if matcher.accept_token(token_id):
                steps[i] = GrammarStep.ENDED if matcher.is_terminated() else GrammarStep.OPEN
            elif matcher.is_completed():
                # The stop token the complete grammar asked for was masked (min_tokens; the producer
                # refuses that pair): end the output rather than run on unconstrained.
                log.warning("%s: sampled token %d is outside its complete grammar; ending it", req.id, token_id)
                steps[i] = GrammarStep.ENDED
            else:  # no token was allowed: a schema whose parts contradict (the engine fails the request)
                steps[i] = GrammarStep.STUCK
        return steps
