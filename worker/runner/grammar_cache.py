"""Compiled grammars of one tokenizer, compiled off the model loop.

A constraint compiles in a few ms when typical, but a large schema (many
properties, nested ``anyOf``, long enums, counted repetitions in patterns)
or a big EBNF takes hundreds of ms to seconds; on the model loop that
stalled every running request of the worker. So compiles run on a few
threads of their own (xgrammar's ``GrammarCompiler`` is thread-safe and its
calls release the GIL: tvm-ffi's default, ``TVM_FFI_RELEASE_GIL_BY_DEFAULT``)
and the loop asks ``status`` without waiting: compiled, failed, or not yet.
One future per constraint: requests sending the same schema while it
compiles share one compile (as SGLang's grammar backend and vLLM's
structured-output manager do).

Invariant: ``_compiled``, ``_compiling`` and ``_failed`` are read and
changed on the model loop's thread only; the compile threads run the
compile function and set its future, nothing else.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from shared.schemas import Constraint

log = logging.getLogger("lightq.worker")

CACHE_ENTRIES = 128  # compiled grammars kept per worker (a JSON schema's is tens of kB to a few MB)
COMPILE_THREADS = 2  # compiles at once (each on xgrammar's own threads too: COMPILER_THREADS)
COMPILER_THREADS = 2

CompileFn = Callable[[xgr.GrammarCompiler, Constraint], xgr.CompiledGrammar]

# xgrammar (0.2.9 and before; mlc-ai/xgrammar#800, fixes open as #822/#880) lowers a string with
# minLength/maxLength to a repetition of this class, which admits raw U+0000-U+001F: a sampled
# answer then held a raw control byte and failed json.loads. The rule is rewritten to the class
# its unbounded strings use; once xgrammar prints a fixed rule, the text is absent and nothing changes.
_LOOSE_CHARACTERS = r"_characters ::= (([^\"\\\r\n]))"
_JSON_CHARACTERS = r"_characters ::= (([^\0-\x1f\"\\]))"


def json_schema_grammar(spec: str) -> xgr.Grammar:
    """A JSON schema's grammar, compact (no free whitespace), with no raw control character
    allowed in a length-bounded string (see _LOOSE_CHARACTERS)."""
    grammar = xgr.Grammar.from_json_schema(spec, any_whitespace=False)
    text = str(grammar)
    if _LOOSE_CHARACTERS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTERS, _JSON_CHARACTERS))


def compile_constraint(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    """One constraint against the worker's tokenizer. JSON is compact (no free whitespace): a
    sampled model could otherwise spend its whole budget on spaces and newlines."""
    if constraint.kind == "json":
        return compiler.compile_grammar(xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False))
    if constraint.kind == "json_schema":
        return compiler.compile_grammar(json_schema_grammar(constraint.spec))
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.spec)
    return compiler.compile_grammar(constraint.spec)


@dataclass(frozen=True)
class CompileFailed:
    """Why a constraint cannot be compiled here (the request's error message)."""

    message: str


@dataclass(frozen=True)
class _Compiled:
    grammar: xgr.CompiledGrammar
    seconds: float  # wall time of the compile, for the worker's histogram


class CompileThreads:
    """A few daemon threads running compiles in order of submission. Not a ThreadPoolExecutor:
    its threads are joined at interpreter exit, so a stopping worker would wait out a runaway
    compile; a daemon thread is abandoned with it."""

    def __init__(self, num_threads: int) -> None:
        self._queue: queue.SimpleQueue[tuple[futures.Future, Callable[[], Any]]] = queue.SimpleQueue()
        for n in range(num_threads):
            threading.Thread(target=self._run, name=f"grammar-compile-{n}", daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> futures.Future:
        future: futures.Future = futures.Future()
        self._queue.put((future, fn))
        return future

    def _run(self) -> None:
        while True:
            future, fn = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to the loop, which fails the requests waiting on it
                future.set_exception(exc)


class GrammarCache:
    """Compiled grammars of one tokenizer, least recently used first out, plus the compiles under way
    and the constraints that failed (as many, also least recently used first out)."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        vocab_size: int,
        max_entries: int = CACHE_ENTRIES,
        compile_fn: CompileFn = compile_constraint,
        num_threads: int = COMPILE_THREADS,
    ) -> None:
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS, cache_enabled=False)
        self.max_entries = max_entries
        self._compile_fn = compile_fn  # tests inject a slow or counting one
        self._threads = CompileThreads(num_threads)
        self._compiled: OrderedDict[Constraint, xgr.CompiledGrammar] = OrderedDict()
        self._compiling: dict[Constraint, futures.Future] = {}
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
        self._compiling[constraint] = self._threads.submit(lambda: self._timed_compile(constraint))

    def _timed_compile(self, constraint: Constraint) -> _Compiled:
        started = time.perf_counter()
        grammar = self._compile_fn(self.compiler, constraint)
        return _Compiled(grammar, time.perf_counter() - started)

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

    def _harvest(self, constraint: Constraint, future: futures.Future) -> None:
        try:
            done: _Compiled = future.result()
        except Exception as exc:  # xgrammar reports bad input as RuntimeError
            if not isinstance(exc, (RuntimeError, ValueError)):
                log.exception("compiling a %s constraint failed unexpectedly", constraint.kind, exc_info=exc)
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            _put(self._failed, constraint, CompileFailed(f"invalid {constraint.kind} constraint: {message}"))
            _trim(self._failed, self.max_entries)
            return
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

    def __len__(self) -> int:
        return len(self._compiled)


def _put(entries: OrderedDict, key: Constraint, value: Any) -> None:
    entries[key] = value
    entries.move_to_end(key)


def _trim(entries: OrderedDict, max_entries: int) -> None:
    while len(entries) > max_entries:
        entries.popitem(last=False)
