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
kept in a bounded LRU (``GrammarCache``), so a schema sent with every
request compiles once per worker. Compilation runs on the model loop, when
the service takes the request from its inbox (a few ms for a typical schema;
the producer has already parsed the constraint).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from shared.schemas import Constraint
from worker.engine.request import Req

log = logging.getLogger("lightq.worker")

CACHE_ENTRIES = 128  # compiled grammars kept per worker (a JSON schema's is tens of kB to a few MB)
COMPILE_THREADS = 2


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """One constraint against the worker's tokenizer. JSON is compact (no free whitespace): a
    sampled model could otherwise spend its whole budget on spaces and newlines."""
    if constraint.kind == "json":
        return compiler.compile_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
    if constraint.kind == "json_schema":
        return compiler.compile_json_schema(constraint.spec, any_whitespace=False)
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.spec)
    return compiler.compile_grammar(constraint.spec)


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used first out."""

    def __init__(self, info: xgr.TokenizerInfo, vocab_size: int, max_entries: int = CACHE_ENTRIES) -> None:
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self.max_entries = max_entries
        self._compiled: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()

    @classmethod
    def for_tokenizer(
        cls, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], max_entries: int = CACHE_ENTRIES
    ) -> GrammarCache:
        """The cache of a Hugging Face tokenizer. The model's vocabulary (logits' width) may exceed
        the tokenizer's; stop tokens are the engine's EOS ids, so the grammar's end and "stop" agree."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        return cls(info, vocab_size, max_entries)

    def get(self, constraint: Constraint) -> xgr.CompiledGrammar:
        compiled = self._compiled.get(constraint)
        if compiled is None:
            compiled = compile_constraint(self.compiler, constraint)
            self._compiled[constraint] = compiled
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(constraint)
        return compiled

    def error(self, constraint: Constraint) -> str | None:
        """Why ``constraint`` cannot be compiled here (None: it can, and it is now cached)."""
        try:
            self.get(constraint)
        except (RuntimeError, ValueError) as exc:  # xgrammar reports bad input as RuntimeError
            return f"invalid {constraint.kind} constraint: {str(exc).strip().splitlines()[-1]}"
        return None

    def __len__(self) -> int:
        return len(self._compiled)


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
    """The matchers of the samples that hold a table row and have a constraint."""

    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self.matchers: dict[Req, xgr.GrammarMatcher] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, cache.vocab_size)
        self._filler = xgr.BatchGrammarMatcher(max_threads="auto")  # a row per thread, ~50 us a row

    def start(self, req: Req) -> None:
        """A matcher for ``req`` (none without a constraint), after its output so far."""
        constraint = req.msg.params.constraint
        if constraint is None:
            self.matchers.pop(req, None)
            return
        matcher = xgr.GrammarMatcher(self.cache.get(constraint))
        for n, token_id in enumerate(req.output_ids):
            if not matcher.accept_token(token_id):
                # Cannot happen with the grammar the tokens were sampled under; the rest of the
                # output is then unconstrained from the last accepted state, which is logged.
                log.warning("%s: emitted token %d (index %d) rejected on replay", req.id, token_id, n)
                break
        self.matchers[req] = matcher

    def finish(self, req: Req) -> None:
        self.matchers.pop(req, None)

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

    def accept(self, reqs: Sequence[Req], ids: Sequence[int]) -> list[bool]:
        """Advance each constrained sample's matcher by its sampled token; per row, whether the
        grammar has ended the output (complete, and a stop token taken)."""
        ended = [False] * len(reqs)
        for i, (req, token_id) in enumerate(zip(reqs, ids)):
            matcher = self.matchers.get(req)
            if matcher is None:
                continue
            if not matcher.accept_token(token_id):
                # Only when no token was allowed at all (e.g. min_tokens masked the stop token the
                # complete grammar asked for): end the output rather than run on unconstrained.
                log.warning("%s: sampled token %d is outside its grammar; ending it", req.id, token_id)
                ended[i] = True
            else:
                ended[i] = matcher.is_terminated()
        return ended
