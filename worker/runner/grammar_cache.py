"""Compiled grammars of one tokenizer, compiled off the model loop.

A constraint compiles in a few ms when typical, but a large schema (many
properties, nested ``anyOf``, long enums, counted repetitions in patterns)
or a big EBNF takes hundreds of ms to minutes; on the model loop that
stalled every running request of the worker. So compiles run in processes
of their own (``worker.runner.compile_pool``: a slow compile never holds up
a cheap one, and one nobody waits for any more is stopped) and the loop
asks ``status`` without waiting: compiled, failed, or not yet. One compile
per constraint: requests sending the same one while it compiles share it
(as SGLang's grammar backend and vLLM's structured-output manager do), and
a compiled grammar stays in a bounded LRU, so a schema sent with every
request compiles once per worker.

A constraint compiles from the producer's parse (``Constraint.grammar``,
xgrammar's EBNF text): the schema is not converted again here.

Invariant: ``_compiled``, ``_compiling`` and ``_failed`` are read and
changed on the model loop's thread only; the pool's dispatcher thread
resolves the futures, nothing else.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from shared.schemas import Constraint
from worker.runner.compile_pool import PROCESSES, SLOW_AFTER_S, Compiled, CompileFn, CompilePool, PoolStopped

log = logging.getLogger("lightq.worker")

CACHE_ENTRIES = 128  # compiled grammars kept per worker (a JSON schema's is tens of kB to a few MB)

# xgrammar (0.2.9 and before; mlc-ai/xgrammar#800, fixes open as #822/#880) lowers a string with
# minLength/maxLength to a repetition of this class, which admits raw U+0000-U+001F: a sampled
# answer then held a raw control byte and failed json.loads. The rule is rewritten to the class
# its unbounded strings use; once xgrammar prints a fixed rule, the text is absent and nothing changes.
_LOOSE_CHARACTERS = r"_characters ::= (([^\"\\\r\n]))"
_JSON_CHARACTERS = r"_characters ::= (([^\0-\x1f\"\\]))"


def json_schema_text(grammar: str) -> str:
    """A JSON schema's grammar text with no raw control character allowed in a length-bounded
    string (see _LOOSE_CHARACTERS)."""
    return grammar.replace(_LOOSE_CHARACTERS, _JSON_CHARACTERS)


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """One constraint against the worker's tokenizer (in a compile process). JSON is compact (no
    free whitespace): a sampled model could otherwise spend its whole budget on spaces and newlines.
    The producer's parse (``grammar``) is compiled as it is; a message without one is parsed here."""
    if constraint.kind == "json":
        return compiler.compile_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
    grammar = constraint.grammar
    if not grammar and constraint.kind == "json_schema":
        grammar = str(xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False))
    elif not grammar and constraint.kind == "regex":
        grammar = str(xgr.Grammar.from_regex(constraint.spec))
    elif not grammar:
        grammar = constraint.spec
    return compiler.compile_grammar(json_schema_text(grammar) if constraint.kind == "json_schema" else grammar)


@dataclass(frozen=True)
class CompileFailed:
    """Why a constraint cannot be compiled here (the request's error message)."""

    message: str


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used first out, plus the compiles under way
    and the constraints that failed (as many, also least recently used first out)."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        vocab_size: int,
        max_entries: int = CACHE_ENTRIES,
        compile_fn: CompileFn = compile_constraint,
        processes: int = PROCESSES,
        slow_after_s: float = SLOW_AFTER_S,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        # compile_fn runs in the compile processes (tests give a gated one: a module-level function)
        self.pool = CompilePool(info, compile_fn, processes, slow_after_s)
        self._compiled: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._compiling: dict[Constraint, futures.Future[Compiled]] = {}
        self._failed: OrderedDict[Constraint, CompileFailed] = OrderedDict()
        self._seconds: list[float] = []  # compile times not yet taken by the metrics (take_compile_times)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int], **kwargs: Any) -> GrammarCache:
        """The cache of a Hugging Face tokenizer. The model's vocabulary (logits' width) may exceed
        the tokenizer's; stop tokens are the engine's EOS ids, so the grammar's end and "stop" agree."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        return cls(info, vocab_size, **kwargs)

    def submit(self, constraint: Constraint) -> None:
        """Start compiling ``constraint`` unless it is compiled, compiling or known to fail."""
        if constraint in self._compiled or constraint in self._compiling or constraint in self._failed:
            return
        self._compiling[constraint] = self.pool.submit(constraint)

    def cancel(self, constraint: Constraint) -> None:
        """Stop compiling ``constraint`` (nobody waits for it any more); a later submit starts again."""
        future = self._compiling.pop(constraint, None)
        if future is not None and future.done():
            self._harvest(constraint, future)  # finished after all: kept
        elif future is not None:
            self.pool.cancel(future)

    def status(self, constraint: Constraint) -> xgr.CompiledGrammar | CompileFailed | None:
        """The compiled grammar, why it failed, or None while it compiles (or was never submitted).
        Never waits; a finished compile moves into the LRU here."""
        compiled = self._compiled.get(constraint)
        if compiled is not None:
            self._compiled.move_to_end(constraint)
            return compiled
        future = self._compiling.get(constraint)
        if future is not None and future.done():
            del self._compiling[constraint]
            self._harvest(constraint, future)
            return self.status(constraint)
        return self._failed.get(constraint)

    def _harvest(self, constraint: Constraint, future: futures.Future[Compiled]) -> None:
        try:
            done: Compiled = future.result()
        except Exception as exc:  # CompileError: xgrammar's reason, or its process died
            message = str(exc).strip() or type(exc).__name__
            failed = CompileFailed(f"{Constraint.INVALID}: the {constraint.kind} constraint: {message}")
            if isinstance(exc, PoolStopped):  # the worker's fault, not the constraint's (a 500)
                log.error("compiling a %s constraint: %s", constraint.kind, message)
                failed = CompileFailed(f"the {constraint.kind} constraint was not compiled: {message}")
            _put(self._failed, constraint, failed)
            _trim(self._failed, self.max_entries)
            return
        log.info("compiled a %s grammar in %.3f s", constraint.kind, done.seconds)
        self._seconds.append(done.seconds)
        _put(self._compiled, constraint, done.grammar)
        _trim(self._compiled, self.max_entries)

    def get(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar, compiled now if need be (waits: for callers off the serving path,
        and tests); raises ValueError when it cannot be compiled."""
        self.submit(constraint)
        future = self._compiling.get(constraint)
        if future is not None:
            futures.wait([future])
        status = self.status(constraint)
        if isinstance(status, CompileFailed):
            raise ValueError(status.message)
        assert status is not None, "a finished compile is harvested by status()"
        return status

    def error(self, constraint: Constraint) -> str | None:
        """Why ``constraint`` cannot be compiled here (None: it can, and it is now cached); waits."""
        try:
            self.get(constraint)
        except ValueError as exc:
            return str(exc)
        return None

    def wait(self, timeout: float) -> None:
        """Until a compile under way finishes, at most ``timeout`` seconds (at once when none is)."""
        if self._compiling:
            futures.wait(list(self._compiling.values()), timeout, return_when=futures.FIRST_COMPLETED)

    def take_compile_times(self) -> list[float]:
        """Seconds of each compile finished since the last call (the worker's histogram)."""
        taken, self._seconds = self._seconds, []
        return taken

    def close(self) -> None:
        """Stop the compile processes (compiles under way fail)."""
        self.pool.close()

    def __len__(self) -> int:
        return len(self._compiled)


def _put(entries: OrderedDict[Constraint, Any], key: Constraint, value: Any) -> None:
    entries[key] = value
    entries.move_to_end(key)


def _trim(entries: OrderedDict[Constraint, Any], max_entries: int) -> None:
    while len(entries) > max_entries:
        entries.popitem(last=False)
