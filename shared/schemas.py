"""Typed messages for every hop, serialised as JSON by ``shared.codec``.

producer --GenerateRequest--> {q}:requests --router--> {q}:w:ID:inbox --> worker
worker --ChunkRun--> {rN-K}:ID:chunks (durable) and {rN-K}:ID:tokens (pub/sub); readers see TokenChunks
worker --WorkerLoad--> {q}:w:ID:load (heartbeat with TTL)
router, worker --DeadLetter--> {q}:dead (read by ``lightq dead-letters``)
router --PreemptAsk--> {q}:w:ID:preempt --> worker
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

MAX_TOP_LOGPROBS = 20  # OpenAI chat's limit (completions' is 5)
# Priorities are small integers: each one in use is a sorted set of its own in Redis (router.ordering).
MIN_PRIORITY, MAX_PRIORITY = -100, 100
DEFAULT_TENANT = "default"
# The fair-share bucket of tenants past the router's --max_tenants, and the /metrics series of
# tenants past --metrics_tenants (router.ordering): per-tenant state stays bounded.
OTHER_TENANT = "other"
MAX_TENANT_CHARS = 128

FinishReason = Literal["stop", "length", "cancelled", "error", "expired"]


class RequestStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed while it waited; it never ran

    @property
    def is_terminal(self) -> bool:
        return self is not RequestStatus.QUEUED and self is not RequestStatus.RUNNING


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Constraint(_Frozen):
    """A grammar the output must follow (constrained decoding, ``worker.runner.grammar``).

    ``spec`` is the JSON schema as JSON text (``json_schema``), the regular
    expression (``regex``) or the EBNF grammar (``ebnf``); empty for ``json``
    (any JSON object or value, OpenAI's ``json_object``). The producer checks
    its cost bounds and parses it before anything is queued, and sends its
    parse as ``grammar`` (xgrammar's EBNF text: a JSON schema's conversion,
    the costly part of a parse, is done once); the worker compiles ``grammar``
    against its tokenizer, and parses ``spec`` itself only when ``grammar`` is
    empty (``json``, or a message from an older producer). When the grammar
    is complete the output ends (``stop``).
    """

    kind: Literal["json", "json_schema", "regex", "ebnf"]
    spec: str = ""
    grammar: str = ""

    # A request whose constraint the worker cannot apply ends with an error that starts with one of
    # these codes and ": ": the client's to change (the producer answers 400 with the code, not a
    # 500): xgrammar refused it, or it did not compile within --grammar_compile_timeout_s.
    INVALID: ClassVar[str] = "invalid_constraint"
    TOO_COSTLY: ClassVar[str] = "constraint_too_costly"

    @staticmethod
    def error_code(error: str | None) -> str | None:
        """``INVALID`` or ``TOO_COSTLY`` when a request's ``error`` is its constraint's, else None."""
        code = (error or "").split(": ", 1)[0]
        return code if code in (Constraint.INVALID, Constraint.TOO_COSTLY) else None


class SamplingParams(_Frozen):
    """Validated generation parameters, as the worker applies them."""

    max_new_tokens: int = Field(16, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    ignore_eos: bool = False
    seed: int | None = None
    # Below: defaults are neutral, so a message without them means what it always did.
    min_new_tokens: int = Field(0, ge=0, description="EOS is masked until this many tokens are out")
    stop_sequences: tuple[str, ...] = Field(
        (), description="texts that end the output, never emitted (the producer drops empty ones)"
    )
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0, le=1)
    top_logprobs: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS, description="most likely alternatives to report with each token's logprob"
    )
    constraint: Constraint | None = Field(None, description="a grammar the output must follow (None: free text)")
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="each prompt token's logprob (after the first) with this many alternatives, computed "
        "from the prefill and sent with the first output token (None: not asked)",
    )

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample or self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class GenerateRequest(_Frozen):
    """One request as it travels producer -> router -> worker.

    ``resume_ids`` are output tokens an earlier attempt already emitted (and
    the client already saw); a worker continues after them, numbering its
    chunks from ``len(resume_ids)``.

    ``n`` > 1 makes a group: n samples of one prompt (``n``/``best_of``),
    carried as this one message so they land on one worker together, which
    prefills the prompt once and shares its KV slots between the samples.
    Their chunks carry ``choice`` 0..n-1. A group goes back to the queue
    whole (see shared.requeue) with ``group_resume[c]``, the tokens sample
    ``c`` already emitted, and ``finished_choices``, the samples that already
    ended; the next worker runs only the others, each after its own tokens
    (``resume_ids`` stays empty for a group).
    """

    kind: Literal["generate"] = "generate"
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    created_ms: int
    attempt: int = 0
    resume_ids: list[int] = Field(default_factory=list)
    deadline_ms: int | None = None  # Unix ms; a request still queued past it ends ``expired``
    n: int = Field(1, ge=1, description="samples of this prompt (a group when > 1), prompt held once")
    model: str | None = Field(
        None, description="the served model name it is for: only workers serving it take it (None: any worker)"
    )
    adapter: str | None = Field(
        None,
        description="the LoRA adapter (a --lora_modules name) its tokens are generated with (None: the base "
        "model): only workers publishing it take it; it travels with every requeue",
    )
    # Scheduling (router.ordering): classes by ``priority`` (lower first, as in vLLM), and within
    # a class fair shares of tokens between tenants. The producer sets ``tenant`` (the API key's
    # tenant, or OpenAI's ``user`` where keys are off); defaults keep older messages valid.
    priority: int = Field(0, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="lower is served earlier")
    tenant: str = Field(DEFAULT_TENANT, min_length=1, max_length=MAX_TENANT_CHARS)
    # A requeued group's progress (empty, the defaults, for a fresh one): per choice the tokens it
    # already emitted, and the choices that already ended (never run again).
    group_resume: list[list[int]] = Field(default_factory=list)
    finished_choices: list[int] = Field(default_factory=list)
    # Times a worker paused it for a better class (worker.engine.preempt); at --max_preemptions
    # it is never paused again, so a request cannot be bounced around forever.
    preemptions: int = Field(0, ge=0)
    # Worker deaths it ran through: ``attempt`` counts those blamed on it (shared.requeue), this
    # every one, so a request that kills workers where it is not blamed is still stopped.
    deaths: int = Field(0, ge=0)
    # The producer that follows its chunks (its wake stream, Keys.wake): told which requests a flush
    # wrote, it reads only those streams (None: nobody to tell, e.g. a batch job's request).
    reply_to: str | None = None

    @model_validator(mode="after")
    def _check_group_resume(self) -> GenerateRequest:
        if self.group_resume and (self.n == 1 or len(self.group_resume) != self.n):
            raise ValueError("group_resume needs a group (n > 1) and one list per choice")
        done = self.finished_choices
        # A proper subset: a group whose every choice finished has ended and is never requeued.
        if done and (done != sorted(set(done)) or not set(done) < set(range(self.n))):
            raise ValueError("finished_choices: distinct sorted choices of a group, not all of them")
        return self

    @property
    def open_choices(self) -> list[int]:
        """The samples still to run: every choice but those a requeued group already finished."""
        return [c for c in range(self.n) if c not in self.finished_choices]

    def emitted(self, choice: int) -> list[int]:
        """Tokens sample ``choice`` emitted before this attempt (a single request's ``resume_ids``)."""
        if self.n == 1:
            return self.resume_ids
        return self.group_resume[choice] if self.group_resume else []

    @property
    def num_emitted(self) -> int:
        """Output tokens of every sample before this attempt (finished samples included)."""
        return sum(len(self.emitted(c)) for c in range(self.n))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_tokens_needed(self) -> int:
        """Most KV tokens this request (all its samples) can ever hold: the prompt once,
        each sample's output (the conservative need)."""
        return len(self.prompt_ids) + self.n * self.params.max_new_tokens


class TokenChunk(_Frozen):
    """One generated token; ``index`` is its 0-based position in the output
    of sample ``choice`` (always 0 unless the request is a group, n > 1).

    The last chunk of a sample has ``finished`` set; a request is done when
    every choice is. A request that ends without a token of its own
    (cancelled, failed, expired) gets a chunk whose ``token_id`` is None,
    ``text`` empty and ``index`` the count of tokens before it: such a chunk
    ends every choice of the request that has not finished. Readers drop a
    chunk whose (choice, index) they already delivered.

    ``top_logprobs``: when the request asked for alternatives
    (``SamplingParams.top_logprobs``), the most likely tokens at this
    position as (token id, logprob), most likely first, from the same
    distribution as ``logprob``; absent from the JSON otherwise.
    """

    kind: Literal["chunk"] = "chunk"
    request_id: str
    index: int
    choice: int = 0
    token_id: int | None
    text: str = ""
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    # With the first token of a request that asked (SamplingParams.prompt_logprobs): per prompt
    # token after the first, (its logprob, (id, logprob) alternatives most likely first).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None

    @classmethod
    def built(cls, values: dict[str, Any]) -> TokenChunk:
        """A chunk from values a validated ``ChunkRun`` holds (every field given): what
        ``model_construct`` does without its per-field pass, a fifth of its time. A reader makes
        one per token delivered."""
        chunk = cls.__new__(cls)
        object.__setattr__(chunk, "__dict__", values)
        object.__setattr__(chunk, "__pydantic_fields_set__", set(values))
        object.__setattr__(chunk, "__pydantic_extra__", None)
        object.__setattr__(chunk, "__pydantic_private__", None)
        return chunk

    @model_serializer(mode="wrap")
    def _without_empty_top(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """One chunk per token goes over Redis: no ``top_logprobs: null`` on every one."""
        data: dict[str, Any] = handler(self)
        for key in ("top_logprobs", "prompt_logprobs"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


CHUNK_FORMAT: Literal[2] = 2  # the chunk entries workers write: 1, a TokenChunk per token; 2, a ChunkRun per run


class ChunkRun(_Frozen):
    """A chunk stream entry of format 2: consecutive tokens of one sample, written at once.

    The tokens are ``index``, ``index + 1``, ... of sample ``choice``; ``token_ids``,
    ``texts`` and ``logprobs`` have one item each (``top_logprobs`` too, when the request
    asked for alternatives). A run with ``finished`` set ends its sample with its last
    token; a run without tokens is an end of its own (cancelled, failed, expired: see
    ``TokenChunk``, which is what readers make of a run, one per token, ``tokens()``).
    Format 1 entries (a ``TokenChunk`` each) are read as runs of one (``shared.chunks``).
    """

    kind: Literal["run"] = "run"
    v: Literal[2] = CHUNK_FORMAT
    request_id: str
    choice: int = 0
    index: int = Field(ge=0, description="the first token's index (the tokens before it, for a run without tokens)")
    token_ids: list[int] = Field(default_factory=list)
    texts: list[str] = Field(default_factory=list)
    logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # with the sample's token 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _check_columns(self) -> ChunkRun:
        n = len(self.token_ids)
        tops = n if self.top_logprobs is None else len(self.top_logprobs)
        if len(self.texts) != n or len(self.logprobs) != n or tops != n:
            raise ValueError("a run has one text, logprob (and top_logprobs entry) per token id")
        if n == 0 and not self.finished:
            raise ValueError("a run without tokens must end its sample")
        return self

    @model_serializer(mode="wrap")
    def _without_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("top_logprobs", "prompt_logprobs", "finish_reason", "error"):
            if data.get(key) is None:
                data.pop(key, None)
        return data

    def tokens(self) -> list[TokenChunk]:
        """The run as readers take it: a chunk per token (the last one ``finished`` when the run
        is), or the one tokenless chunk of an end without a token."""
        rid, choice, first = self.request_id, self.choice, self.index
        if not self.token_ids:
            return [TokenChunk.built(_chunk(rid, first, choice, None, "", None, None, None, True, self))]
        last = len(self.token_ids) - 1
        tops, texts, logprobs = self.top_logprobs, self.texts, self.logprobs
        prompt = self.prompt_logprobs if first == 0 else None
        return [
            TokenChunk.built(
                _chunk(
                    rid,
                    first + i,
                    choice,
                    token_id,
                    texts[i],
                    logprobs[i],
                    tops[i] if tops is not None else None,
                    prompt if i == 0 else None,
                    self.finished and i == last,
                    self if i == last else None,
                )
            )
            for i, token_id in enumerate(self.token_ids)
        ]

    @classmethod
    def of(cls, chunk: TokenChunk) -> ChunkRun:
        """A format-1 entry as the run of its one token (or its tokenless end)."""
        has_token = chunk.token_id is not None
        return cls.model_construct(
            kind="run",
            v=CHUNK_FORMAT,
            request_id=chunk.request_id,
            choice=chunk.choice,
            index=chunk.index,
            token_ids=[chunk.token_id] if chunk.token_id is not None else [],
            texts=[chunk.text] if has_token else [],
            logprobs=[chunk.logprob] if has_token else [],
            top_logprobs=[chunk.top_logprobs] if has_token and chunk.top_logprobs is not None else None,
            prompt_logprobs=chunk.prompt_logprobs,
            finished=chunk.finished,
            finish_reason=chunk.finish_reason,
            error=chunk.error,
        )


def _chunk(
    request_id: str,
    index: int,
    choice: int,
    token_id: int | None,
    text: str,
    logprob: float | None,
    top: list[tuple[int, float]] | None,
    prompt: list[tuple[float, list[tuple[int, float]]]] | None,
    finished: bool,
    end: ChunkRun | None,
) -> dict[str, Any]:
    """A ``TokenChunk``'s fields, every one of them; ``end``: the run whose end this token carries."""
    return {
        "kind": "chunk",
        "request_id": request_id,
        "index": index,
        "choice": choice,
        "token_id": token_id,
        "text": text,
        "logprob": logprob,
        "top_logprobs": top,
        "prompt_logprobs": prompt,
        "finished": finished,
        "finish_reason": end.finish_reason if end is not None else None,
        "error": end.error if end is not None else None,
    }


class WorkerLoad(_Frozen):
    """A worker's heartbeat: enough for the router's admission check."""

    kind: Literal["load"] = "load"
    worker_id: str
    seq: int
    ts_ms: int
    max_total_tokens: int
    used_tokens: int
    committed_tokens: int = Field(description="sum of prompt + max_new_tokens over running and waiting requests")
    num_running: int
    num_waiting: int
    last_inbox_id: str = Field("0-0", description="newest inbox entry the worker has taken in")
    draining: bool = False
    model: str | None = Field(None, description="the served model name (None: takes any request)")
    running_max_req_size: int | None = Field(None, description="most requests the worker runs at once")
    adapters: list[str] = Field(
        default_factory=list, description="the LoRA adapters new requests may name here (--lora_modules', run-time)"
    )
    resident_adapters: list[str] = Field(
        default_factory=list, description="the LoRA adapters in device memory now (unloaded ones still in use too)"
    )
    lora_failed: list[tuple[str, str, str]] = Field(
        default_factory=list, description="run-time LoRA adapters this worker could not load: [name, folder, why]"
    )
    requests: list[tuple[int, int, int, int]] = Field(
        description="per running or waiting request: [prompt + output tokens, output tokens, "
        "max_new_tokens, ignore_eos 0/1] (shared.peak.ReqState), a group's prompt counted once"
    )
    prefix_cache: bool = Field(False, description="the worker keeps a prefix cache (off: --no-prefix_cache)")
    cached_tokens: int = Field(0, description="tokens the prefix cache holds (0: off)")
    prefixes: list[tuple[int, int]] = Field(
        default_factory=list,
        description="what the prefix cache holds, bounded: [prefix hash, tokens it covers] "
        "(shared.prefix_hash), the most recently used first",
    )
    held_prefixes: list[int] = Field(
        default_factory=list,
        description="indexes into prefixes of the entries whose tokens running requests hold (counted "
        "in requests): a request starting with one adds only the rest here (router.admission); the "
        "other entries are evictable, and a request that hits them holds them again",
    )
    prefix_asked_tokens: int = Field(0, description="tokens of admitted requests looked up in the cache, since start")
    prefix_hit_tokens: int = Field(0, description="of those, tokens found cached (not prefilled)")
    prefix_evicted_tokens: int = Field(0, description="cached tokens evicted to make room, since start")

    preemptible: list[tuple[int, int, int]] = Field(
        default_factory=list,
        description="per priority class with requests this worker would pause for a better class "
        "(worker.engine.preempt): [priority, tokens they hold, request slots (a group's samples each)], "
        "the worst (largest) class first",
    )
    max_preemptions: int = Field(0, description="times this worker pauses one request at most (--max_preemptions)")
    preempt_asks_read: int = Field(
        0, description="preemption asks the worker has read and answered (a router waits for its own)"
    )
    preempted_requests: int = Field(0, description="started requests paused for a better class, since start")
    preempted_kv_tokens: int = Field(0, description="their K/V tokens, computed again on resume (the cost)")

    def serves(self, model: str | None, adapter: str | None = None) -> bool:
        """Whether a request for ``model`` (and LoRA ``adapter``) may come here: one pool per served
        model name, and an adapter only where the worker has loaded it."""
        if adapter is not None and adapter not in self.adapters:
            return False
        return model is None or self.model is None or self.model == model


class PreemptAsk(_Frozen):
    """A router's ask to a worker ({q}:w:ID:preempt): pause enough requests of a class worse than
    ``priority`` that the requests ``request_ids`` fit, as many of them as can, the first first,
    and hand them back to the queue (worker.engine.preempt). ``states``: their
    ``shared.peak.ReqState`` summaries, ``sizes[i]`` of them for the i-th request. The router
    dispatches them to the worker with the ask, so they may be in its queue already."""

    kind: Literal["preempt"] = "preempt"
    request_ids: list[str] = Field(min_length=1)
    priority: int
    states: list[tuple[int, int, int, int]]
    sizes: list[int]
    asked_ms: int

    @model_validator(mode="after")
    def _check_sizes(self) -> PreemptAsk:
        if len(self.sizes) != len(self.request_ids) or sum(self.sizes) != len(self.states):
            raise ValueError("sizes: one per request, adding up to the states")
        return self


class DeadLetter(_Frozen):
    """An entry of the dead-letter stream: a request whose workers died ``max_attempts``
    times, as it was when it was parked (``lightq dead-letters requeue`` sends it back), or an
    ingress entry no router could read, its fields kept as they were for inspection."""

    kind: Literal["dead_letter"] = "dead_letter"
    reason: str
    failed_ms: int
    request: GenerateRequest | None = None
    raw: dict[str, str] | None = Field(None, description="the unreadable entry's fields")

    @model_validator(mode="after")
    def _one_of_request_or_raw(self) -> DeadLetter:
        if (self.request is None) == (self.raw is None):
            raise ValueError("a dead letter holds either its request or the raw fields of an unreadable entry")
        return self


def tally_preemptible(items: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``WorkerLoad.preemptible`` from (priority, tokens, requests) items: summed per class, the
    worst (largest) class first."""
    held: dict[int, tuple[int, int]] = {}
    for priority, tokens, count in items:
        total, requests = held.get(priority, (0, 0))
        held[priority] = (total + tokens, requests + count)
    return [(p, tokens, count) for p, (tokens, count) in sorted(held.items(), reverse=True)]


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id as a comparable (milliseconds, sequence) pair."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RequestMeta(BaseModel):
    """The per-request status hash ({q}:r:ID:meta); every writer goes through this.

    The producer creates it (queued), the router fills ``worker`` on dispatch,
    the worker sets running/finished with counts and times. ``*_ms`` are Unix
    milliseconds: created (enqueued), dispatched (the router's script),
    taken (the worker read its inbox), stepped (the worker step that
    admitted it handed the admission to its publisher, before its prefill:
    a request is ``running`` before its first forward), started (the
    publisher wrote it), finished. Their gaps are the hops of
    time-to-first-token (``bench.serving.serve_bench --hops``; the prefill is in the
    first token's time after ``started``). Partial updates use
    ``fields(...)``.
    """

    model_config = ConfigDict(extra="ignore")

    status: RequestStatus
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    output_tokens: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None
    worker: str | None = None
    attempt: int = 0
    created_ms: int = 0
    dispatched_ms: int | None = None
    taken_ms: int | None = None
    stepped_ms: int | None = None
    started_ms: int | None = None
    finished_ms: int | None = None
    key_hash: str | None = None  # the submitting API key's hash (producer.edge.auth), never the key
    # The tenant whose fair share it is charged to, when not its own: ``other``, its tenant being
    # new to a class already holding --max_tenants tenants (router.ordering). Set by the router
    # that tags it, so a router that reads it again charges it alike.
    charged_to: str | None = None
    # The fencing token (shared.request_log): bumped by every dispatch and by whoever takes the
    # request back (a requeue, an end by a router); a worker writes only with the epoch it got.
    epoch: int = 0

    @staticmethod
    def fields(**values: object) -> dict[str, str]:
        """Hash fields for HSET: enums by value, None dropped."""
        out: dict[str, str] = {}
        for name, value in values.items():
            if name not in RequestMeta.model_fields:
                raise KeyError(f"unknown meta field {name}")
            if value is not None:
                out[name] = value.value if isinstance(value, Enum) else str(value)
        return out

    @classmethod
    def from_hash(cls, data: dict[str, str]) -> RequestMeta:
        return cls.model_validate(data)
