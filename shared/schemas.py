"""Typed messages for every hop, serialised as JSON by ``shared.codec``.

producer --GenerateRequest--> {q}:requests --router--> {q}:w:ID:inbox --> worker
worker --ChunkRun--> {rN-K}:ID:chunks (durable) and {rN-K}:ID:tokens (pub/sub); readers see TokenChunks
worker --WorkerLoad--> {q}:w:ID:load (heartbeat with TTL)
router, worker --DeadLetter--> {q}:dead (read by ``lightq dead-letters``)
router --PreemptAsk--> {q}:w:ID:preempt --> worker

The chunk stream's messages (``ChunkRun``, ``TokenChunk``) are in ``shared.chunk_schemas``, a worker's
load record and the router's preemption ask (``WorkerLoad``, ``PreemptAsk``) in ``shared.worker_load``.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOP_LOGPROBS = 20  # OpenAI chat's limit (completions' is 5)
# Priorities are small integers: each one in use is a sorted set of its own in Redis (router.order.ordering).
MIN_PRIORITY, MAX_PRIORITY = -100, 100
DEFAULT_TENANT = "default"
# The fair-share bucket of tenants past the router's --max_tenants, and the /metrics series of
# tenants past --metrics_tenants (router.order.ordering): per-tenant state stays bounded.
OTHER_TENANT = "other"
MAX_TENANT_CHARS = 128

FinishReason = Literal["stop", "length", "cancelled", "error", "expired"]


class RequestStatus(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"  # its deadline passed while it waited, before its first token

    @property
    def is_terminal(self) -> bool:
        return self is not RequestStatus.QUEUED and self is not RequestStatus.RUNNING


class FrozenModel(BaseModel):
    """The base of every wire message: immutable once built, an unknown field refused (a typo or a
    newer peer's field is an error, not silently dropped)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Constraint(FrozenModel):
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
    # 500): xgrammar refused it, it did not compile within --grammar_compile_timeout_s, or the worker
    # applies no grammars (the counting stand-in).
    INVALID: ClassVar[str] = "invalid_constraint"
    TOO_COSTLY: ClassVar[str] = "constraint_too_costly"
    UNSUPPORTED: ClassVar[str] = "constraint_unsupported"

    @staticmethod
    def error_code(error: str | None) -> str | None:
        """The code (``INVALID``, ``TOO_COSTLY``, ``UNSUPPORTED``) when a request's ``error`` is its
        constraint's, else None."""
        code = (error or "").split(": ", 1)[0]
        return code if code in (Constraint.INVALID, Constraint.TOO_COSTLY, Constraint.UNSUPPORTED) else None


class SamplingParams(FrozenModel):
    """Validated generation parameters, as the worker applies them."""

    max_new_tokens: int = Field(16, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0, le=1e6)  # finite in float32, as every float here
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
    repetition_penalty: float = Field(1.0, ge=1e-3, allow_inf_nan=False)  # its reciprocal finite in float32
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


class GenerateRequest(FrozenModel):
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
    deadline_ms: int | None = None  # Unix ms; one still queued past it with nothing emitted ends ``expired``
    n: int = Field(1, ge=1, description="samples of this prompt (a group when > 1), prompt held once")
    model: str | None = Field(
        None, description="the served model name it is for: only workers serving it take it (None: any worker)"
    )
    adapter: str | None = Field(
        None,
        description="the LoRA adapter (a --lora_modules name) its tokens are generated with (None: the base "
        "model): only workers publishing it take it; it travels with every requeue",
    )
    adapter_path: str | None = Field(
        None,
        description="a run-time adapter's folder as the registry named it when the producer accepted the "
        "request (None: none, or a --lora_modules one): a started request that must move after its adapter "
        "was unloaded is loaded with it from here (``brings_adapter``)",
    )
    # Scheduling (router.order.ordering): classes by ``priority`` (lower first, as in vLLM), and within
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

    @property
    def has_output(self) -> bool:
        """Whether an earlier attempt emitted a token (the client has part of the answer)."""
        return bool(self.resume_ids or self.finished_choices or any(self.group_resume))

    @property
    def brings_adapter(self) -> bool:
        """Whether a worker that no longer serves this request's adapter (unloaded since) loads it for
        this request alone, from ``adapter_path``: only once it started (a client with part of the
        answer gets the rest from the same adapter); one that never started ends ``model_not_found``
        (``shared.lora.gone_error``), as a new request for the adapter is refused."""
        return self.adapter is not None and self.adapter_path is not None and self.has_output

    def expired(self, at_ms: int) -> bool:
        """Past its deadline with nothing emitted: ``timeout`` bounds the wait for an answer to
        start, never an answer under way. A request moved off a dead worker or paused for a better
        class comes back to the queue with its tokens and runs to its end (red team 7: a started
        stream ended ``expired`` halfway after a migration or a pause)."""
        return self.deadline_ms is not None and at_ms > self.deadline_ms and not self.has_output

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


class DeadLetter(FrozenModel):
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
    # new to a class already holding --max_tenants tenants (router.order.ordering). Set by the router
    # that tags it, so a router that reads it again charges it alike.
    charged_to: str | None = None
    # The request's samples (n), written only when above 1: status views and replays read each.
    samples: int = 1
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
