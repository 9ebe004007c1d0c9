"""Typed, frozen settings: one object per process, built once in its main().

Every field can be set from the environment (prefix ``LIGHTQ_``) or from a
command-line flag of the same name (``--max_total_token_num``), which keeps
LightLLM's flag names where they mean the same thing. Common parts are
separate classes composed into each service's settings, never inherited.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import Keys

# How often the router and the worker look up the cancel keys of the requests they hold: a cancel
# waits at most this long to be seen (a lookup is one round trip for every request held).
CANCEL_CHECK_S = 0.05
# Chunk runs (worker.service.pending): a request's tokens are written together at most this often,
# so a token costs Redis a share of one entry, not an entry of its own (bench/serving/redis_cost.py).
STREAM_FLUSH_MS = 50.0


def _frozen(prefix: str) -> SettingsConfigDict:
    return SettingsConfigDict(env_prefix=prefix, frozen=True, extra="ignore", protected_namespaces=())


class RedisSettings(BaseSettings):
    """Where Redis is and which key namespace this deployment owns."""

    model_config = _frozen("LIGHTQ_REDIS_")
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL: redis:// or rediss:// (one server), or redis+cluster://HOST:PORT[,HOST:PORT...] "
        "(rediss+cluster://) for a Redis Cluster, any of its nodes as seeds",
    )
    rq_url: str = Field(
        "",
        description="the plain Redis batch jobs' rq queue uses (rq has no cluster client); "
        "empty: --redis_url, which must then be one server (on a cluster, batches answer 501)",
    )
    key_prefix: str = Field("lightq", description="namespace of every key lightq writes")
    request_ttl_s: int = Field(3600, gt=0, description="seconds a finished request's records stay readable")
    max_connections: int = Field(
        2000, gt=0, description="Redis connections one async client may open (each open stream holds one)"
    )

    @property
    def keys(self) -> Keys:
        """This deployment's key names: the one way a process builds its ``Keys``."""
        return Keys(self.key_prefix)

    @property
    def cluster(self) -> bool:
        return self.url.split("://", 1)[0].endswith("+cluster")

    @property
    def batch_url(self) -> str:
        """Where rq's queue is: ``rq_url``, else ``url`` when that is one server; '' on a cluster without one."""
        return self.rq_url or ("" if self.cluster else self.url)


class ModelSettings(BaseSettings):
    """Which model is served and the request-length limit all services agree on."""

    model_config = _frozen("LIGHTQ_")
    model_dir: str = Field(
        "default",
        description="'default' (embedded SmolLM2), a HF directory, a .gguf file, or dummy:<config dir>",
    )
    max_req_total_len: int = Field(2048, gt=1, description="max prompt + new tokens per request")
    max_req_input_len: int = Field(
        0, ge=0, description="max prompt tokens per request (LightLLM's; 0: only max_req_total_len bounds the prompt)"
    )
    served_model_name: str = Field(
        "",
        description="the model's name in the pool and on the OpenAI routes; "
        "requests go only to workers serving it (default: the model's file or "
        "folder name)",
    )
    # In ModelSettings, not the worker's alone: the producer answers an unknown adapter with a 404
    # before anything is queued, from this same list (lightq serve gives every child the same flags);
    # workers load the files and publish the names they serve, which the router routes by.
    lora_modules: list[str] = Field(
        [],  # pydantic copies a default: no instance shares this list
        description="LoRA adapters served beside the model, each NAME=PATH (a PEFT folder: adapter_config.json "
        "+ adapter_model.safetensors); a request chooses one by NAME (OpenAI's 'model', /generate's "
        "'parameters.adapter'); one that does not fit the model stops the worker at start",
    )

    # Here, not the worker's alone: the producer refuses a run-time adapter over it before writing.
    max_lora_rank: int = Field(
        64,
        gt=0,
        le=256,
        description="largest LoRA rank an adapter may have (--lora_modules: a larger one stops the worker; "
        "at run time: 400)",
    )

    @field_validator("lora_modules")
    @classmethod
    def _check_lora_modules(cls, specs: list[str]) -> list[str]:
        names = [spec.split("=", 1)[0] for spec in specs]
        bad = [spec for spec in specs if "=" not in spec or not spec.split("=", 1)[0] or not spec.split("=", 1)[1]]
        if bad:
            raise ValueError(f"each --lora_modules entry is NAME=PATH, not {bad[0]!r}")
        if len(set(names)) < len(names):
            raise ValueError(f"--lora_modules names an adapter twice: {sorted(names)}")
        return specs

    @property
    def adapter_names(self) -> list[str]:
        """The names --lora_modules gives, in order (each NAME=PATH's NAME)."""
        return [spec.split("=", 1)[0] for spec in self.lora_modules]


class BatchSettings(BaseSettings):
    """Batch jobs (``POST /v1/batches``): the rq queue they go through and how fast they feed the pool."""

    model_config = _frozen("LIGHTQ_BATCH_")
    queue: str = Field("lightq-batch", description="rq queue of batch jobs")
    max_in_flight: int = Field(32, gt=0, description="requests of one batch in the pool at once")
    max_requests: int = Field(50_000, gt=0, description="most lines in one batch file")
    ttl_s: int = Field(7 * 86_400, gt=0, description="seconds a batch's records (input, output) stay readable")
    job_timeout_s: int = Field(86_400, gt=0, description="longest a batch job may run")
    retries: int = Field(2, ge=0, description="restarts of an interrupted batch job (it resumes where it was)")


class HousekeepingSettings(BaseSettings):
    """rq's periodic janitor: trims the ingress stream, sweeps leftover records, drops dead workers."""

    model_config = _frozen("LIGHTQ_HOUSEKEEPING_")
    queue: str = Field("lightq-janitor", description="rq queue of the housekeeping job")
    interval_s: int = Field(60, gt=0, description="seconds between housekeeping runs")
    stale_worker_s: int = Field(
        600,
        gt=0,
        description="a worker unseen this long, with no load record and an empty inbox, leaves the workers set",
    )
    scan_count: int = Field(1000, gt=0, description="keys the request-record sweep looks at per run")


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS says, else the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_producers() -> int:
    """One producer process per 4 cores this process may use, at most 4, at least 1.

    The producer shares the host with Redis, the router and the workers' host
    threads, so it gets a quarter of the cores. One process carried ~5,000
    tok/s of /generate at ~110% CPU on an H200 host (issue 13); four carry more
    than one GPU delivers. A 2-core machine gets 1, as before.
    """
    return min(4, max(1, usable_cores() // 4))


class ProducerSettings(BaseSettings):
    model_config = _frozen("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, description="HTTP port")
    # 0, not default_producers() itself: a default that is the same on every machine (flags, docs).
    producers: int = Field(
        0, ge=0, description="producer processes serving the one port (0: a quarter of the cores, 1 to 4)"
    )
    metrics_refresh_s: float = Field(
        1.0,
        gt=0,
        description="seconds between reads of the cluster view from Redis; /metrics and /dashboard/data serve the last",
    )
    default_max_new_tokens: int = Field(16, gt=0, description="max_new_tokens when a request gives none")
    lora_wait_s: float = Field(
        10.0,
        ge=0,
        description="seconds POST /v1/load_lora_adapter (and unload) waits for a live worker to list the "
        "adapter (not to, unloading) before answering 202 instead of 200 (the change is recorded either way)",
    )
    max_prompts: int = Field(
        64,
        ge=1,
        description="most prompts one /v1/completions request may list (each is queued as a request of its own)",
    )
    stream_block_ms: int = Field(1000, gt=0, description="longest blocking read on a chunk stream")
    redis_timeout_s: float = Field(
        2.0,
        gt=0,
        description="connect and command timeout on Redis: past it a "
        "request gets 503 instead of waiting (blocking reads "
        "get stream_block_ms on top)",
    )
    redis_outage_s: float = Field(
        15.0,
        ge=0,
        description="how long a reader follows a request through a Redis "
        "outage, reconnecting with backoff, before it gives up",
    )
    max_body_bytes: int = Field(2 * 1024 * 1024, gt=0, description="largest request body (413 past it)")
    # A schema's parse grows with its nesting much faster than linearly (xgrammar: 4 ms at 64 levels
    # of JSON, 3 s at 400, 42 s at 800), so both bounds are checked before anything parses it.
    max_schema_chars: int = Field(
        200_000,
        gt=0,
        description="largest JSON schema, regex or grammar a request may constrain its output with, in "
        "characters (response_format, guided_json and the like, each tool's parameters); 400 past it",
    )
    max_schema_depth: int = Field(
        64,
        gt=0,
        description="deepest nesting of objects and arrays in a JSON schema a request sends (a schema level "
        "is about two: properties, then the property); 400 past it",
    )
    max_schema_pattern_cost: int = Field(
        4_000_000,
        ge=0,
        description="most a JSON schema's regex patterns (pattern, patternProperties) may cost the producer's "
        "parse: the sum, over their counted repetitions ({n}, {m,}, {m,n}), of the largest count squared "
        "(xgrammar's conversion grows with that square: ~0.2 us a unit, so the default is under a second); 400 "
        "past it",
    )
    max_batch_body_bytes: int = Field(
        200 * 1024 * 1024, gt=0, description="largest batch file upload (POST /v1/batches; OpenAI's limit)"
    )
    max_queue_tokens: int = Field(
        0,
        ge=0,
        description="backlog limit in queued prompt + estimated output "
        "tokens; past it new requests get 429 (0: no limit)",
    )
    reject_without_workers: bool = Field(False, description="answer 503 (no_workers) while no worker is live")
    api_keys: SecretStr = Field(
        SecretStr(""),
        description="comma-separated API keys; when set, every request "
        "but /health (and /metrics with --metrics_open) needs "
        "'Authorization: Bearer KEY'",
    )
    rate_limit_rpm: int = Field(
        0, ge=0, description="requests (POSTs) per minute per API key; 429 past it (0: no limit)"
    )
    metrics_open: bool = Field(False, description="with --api_keys, leave /metrics open (for scrapers without a key)")
    allowed_origins: str = Field(
        "",
        description="comma-separated origins browsers may call the API from (CORS; "
        "'*' for any); none: cross-origin calls are refused",
    )
    max_auth_failures: int = Field(
        10,
        ge=0,
        description="failed API-key attempts one client address may make "
        "per auth_failure_window_s before it gets 429 (0: no limit)",
    )
    auth_failure_window_s: float = Field(10.0, gt=0, description="window of max_auth_failures, in seconds")
    forwarded_allow_ips: str = Field(
        "",
        description="comma-separated addresses or networks of proxies whose X-Forwarded-For and "
        "X-Forwarded-Proto are trusted ('*': any); none: the connection's own address is the client's",
    )
    metrics_tenants: int = Field(
        16,
        ge=0,
        description="tenants per priority class with /metrics series of their own (the most queued, the "
        "most tokens dispatched); the rest are tenant 'other'",
    )
    batch: BatchSettings = Field(default_factory=BatchSettings)


PolicyName = Literal["conservative", "aggressive", "past_future", "past_future_quantile"]  # shared.admission.POLICIES


class AdmissionSettings(BaseSettings):
    """The admission rule; router and worker apply the same one (shared.admission)."""

    model_config = _frozen("LIGHTQ_")
    admission: PolicyName = Field(
        "past_future",
        description="admission policy: conservative (prompt + max_new_tokens), aggressive "
        "(current use under 95 percent), past_future (Monte-Carlo peak), "
        "past_future_quantile",
    )
    admission_margin: float = Field(0.05, ge=0, lt=1, description="share of a worker's pool past-future keeps free")
    admission_quantile: float = Field(0.9, gt=0, le=1, description="quantile of L | L > d for past_future_quantile")
    admission_seed: int = Field(0, description="seed of the Monte-Carlo length draws")
    history_window: int = Field(200, ge=2, description="recent output lengths the estimate uses")
    history_prior: int = Field(
        2048, gt=0, description="pessimistic output length filling the window until requests finish"
    )
    history_refresh_s: float = Field(1.0, gt=0, description="seconds between reads of the output-length history")


class RouterSettings(BaseSettings):
    model_config = _frozen("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    router_id: str = Field("", description="consumer name in the ingress group (default: host-pid)")
    read_batch: int = Field(64, gt=0, description="ingress entries read per XREADGROUP")
    dispatch_batch: int = Field(32, gt=0, description="admission decisions sent to Redis in one round trip")
    poll_ms: int = Field(100, gt=0, description="idle wait between admission attempts")
    # Not ``admission``: pydantic-settings would read LIGHTQ_ADMISSION, the policy's variable, for it.
    admission_rule: AdmissionSettings = Field(default_factory=AdmissionSettings)
    max_attempts: int = Field(3, ge=1, description="dispatches a request gets before it goes to the dead-letter stream")
    liveness_ttl_s: float = Field(3.0, gt=0, description="a router silent this long is dead: others claim its entries")
    stale_load_s: float = Field(5.0, gt=0, description="a load record older than this counts as full")
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of this service's Prometheus /metrics (0: none; when taken, the next free port above it)",
    )
    # router.ordering: priorities and fair shares apply to what a router holds, so it holds up to this many.
    order_window: int = Field(
        1024, gt=0, description="queued requests of each priority class a router reads ahead to order (by tenant)"
    )
    tenant_weights: str = Field(
        "",
        pattern=r"^$|^[^=,\s]+=[0-9]*\.?[0-9]+(,[^=,\s]+=[0-9]*\.?[0-9]+)*$",
        description="fair-share weights, 'tenant=weight,...' (others weigh 1): weight 2 gets twice the tokens",
    )
    max_tenants: int = Field(
        1000,
        gt=0,
        description="tenants with a fair-share record per priority class; a new tenant past them shares "
        "the 'other' tenant's (those in tenant_weights and 'default' always have their own)",
    )
    metrics_tenants: int = Field(
        16,
        ge=0,
        description="tenants per priority class with /metrics series of their own (the most queued, the "
        "most tokens dispatched); the rest are tenant 'other'",
    )
    cache_aware: bool = Field(
        True,
        description="prefer workers whose prefix cache holds the prompt's prefix, traded against load "
        "(off: by load alone, as before the cache; for comparisons)",
    )
    priority_reserve_slots: int = Field(
        0,
        ge=0,
        description="request slots of each worker that requests of priority > 0 leave free, so a request "
        "of priority <= 0 finds room at once (0: none; idle slots are the price)",
    )
    preempt: bool = Field(
        False,
        description="when the best waiting request fits no worker, ask a worker running requests of a "
        "worse priority class to pause enough of them (handed back to the queue, resumed later; "
        "the recompute costs throughput)",
    )


def default_weights_cache() -> str:
    """``$XDG_CACHE_HOME/lightq/weights``, or under ``~/.cache`` (the XDG default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightq", "weights")


def default_publishers() -> int:
    """Publisher processes per worker: one keeps up with ~25,000 tokens/s on average, but an H200
    at batch 1,000 makes 1,000 tokens per ~25 ms step, more than one process writes in that time
    (issue 13); hosts with 16 cores or more can spare a second."""
    return 2 if usable_cores() >= 16 else 1


class WorkerSettings(BaseSettings):
    model_config = _frozen("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    worker_id: str = Field("", description="unique worker id (default: host-pid)")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:N]'")
    dtype: str = Field("auto", description="'auto' (bf16 on GPU, fp32 on CPU), 'float32', 'float16', 'bfloat16'")
    quantization: Literal["none", "fp8"] = Field(
        "none",
        description="'fp8': the linear layers' weights (per output channel) and inputs (per token) in FP8 e4m3, "
        "quantised at load; a checkpoint published in FP8 (quantization_config 'fp8' or compressed-tensors "
        "'float-quantized') loads as FP8 whatever this says",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="KV pool storage: 'auto' (the model dtype) or 'fp8_e4m3' (8 bits with a scale per token and "
        "head: about 1.9x the tokens in the same memory)",
    )
    max_total_token_num: int | None = Field(
        None, gt=0, description="tokens in the preallocated KV pool (default: from free GPU memory, 8192 on CPU)"
    )
    mem_fraction: float = Field(0.9, gt=0, le=1, description="share of GPU memory weights + KV pool may use")
    gpu_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="this worker's part of --mem_fraction when several workers share one GPU "
        "(lightq serve --workers N on fewer GPUs sets it to 1 / workers on the GPU)",
    )
    batch_max_tokens: int = Field(4096, gt=0, description="max prompt tokens prefilled in one step")
    # LightLLM's default. At 256, a burst of 1,000 requests on an H200 ran 256 at a time while the
    # rest waited in the queue (issue 13); the KV pool, not this cap, should bound the batch.
    running_max_req_size: int = Field(1000, gt=0, description="max requests running at once")
    cuda_graphs: bool = Field(
        True,
        description="capture decode steps, and one-request prefills of at most 512 "
        "tokens (--tp 1), as CUDA graphs (GPU only)",
    )
    graph_max_batch_size: int = Field(
        1000, gt=0, description="largest decode batch captured as a graph (capped by --running_max_req_size)"
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="prepare each decode step on the host while the device runs the last one: its tokens "
        "land a step later, and an end found then costs one token of compute; auto: on a GPU with --tp 1 "
        "('on' also runs it on a CPU, where nothing overlaps: for tests)",
    )
    tp: int = Field(1, ge=1, description="tensor parallel degree: processes (GPUs) per worker")
    publishers: int = Field(
        default_publishers(),
        ge=1,
        description="publisher processes per worker (detokenising and Redis writes, each "
        "a shard of the requests; default: 1, 2 with 16 cores or more)",
    )
    stream_flush_ms: float = Field(
        STREAM_FLUSH_MS,
        ge=0,
        description="how long a publisher gathers a request's tokens into one chunk entry (a run) before "
        "writing it to Redis; a request's first token and its end are written at once (0: every step, for "
        "clients that time each token: one H200 at 16 req/s gave a median gap of 5.75 ms against ~0 within runs "
        "and 52 ms at p99 with 50, for ~3x the Redis work per token)",
    )
    prefix_cache: bool = Field(
        True,
        description="keep ended requests' K/V in a radix tree over the KV pool, so later requests with "
        "the same prefix skip its prefill (off: --no-prefix_cache or --disable_prefix_cache)",
    )
    heartbeat_s: float = Field(0.5, gt=0, description="seconds between load records")
    grammar_compile_timeout_s: float = Field(
        30.0,
        gt=0,
        description="seconds a constrained request waits for its grammar to compile (off the model loop, "
        "while the batch runs) before it ends with an error (400 constraint_too_costly; a compile no "
        "request waits for any more is stopped)",
    )
    admission_rule: AdmissionSettings = Field(default_factory=AdmissionSettings)  # named as the router's
    drain_timeout: float = Field(
        30.0, ge=0, description="on SIGTERM, seconds running requests get to finish before the rest is handed back"
    )
    max_attempts: int = Field(3, ge=1, description="dispatches a request gets before it is dead-lettered")
    max_preemptions: int = Field(
        2, ge=0, description="times a request may be paused for a better priority class (router --preempt)"
    )
    weights_cache: str = Field(
        default_weights_cache(),
        description="folder where a .gguf's dequantised weights are kept (fp32 safetensors, one file per "
        "GGUF), so later starts skip the dequantisation ('': never kept)",
    )
    max_loras: int = Field(
        0,
        ge=0,
        le=1024,
        description="adapter slots on the device for LoRA adapters loaded at run time (POST "
        "/v1/load_lora_adapter), beside --lora_modules' own: a cache of the run-time adapters kept in host "
        "memory (least recently used out); each takes --max_lora_rank on every attention and MLP projection, "
        "allocated at start (0: this worker loads none at run time)",
    )
    seed: int = Field(0, description="seed for dummy weights")
    counting_step_ms: float = Field(
        0.0,
        ge=0,
        description="with --model_dir counting: milliseconds each forward also waits, cores idle, like a "
        "device's step (benchmarks of the serving path on a small CPU)",
    )
    # Fault injection for tests (issue 34): a request that kills every worker it reaches, made on purpose
    # now that the stand-in's own such bug is fixed. Ids >= 4,096 (the stand-in's vocabulary) come only
    # from a prompt: no output ever counts up to one, so ordinary requests never trip them.
    counting_raise_token: int = Field(
        -1,
        ge=-1,
        description="with --model_dir counting, for tests only: a forward whose input holds this token id "
        "raises, which ends the worker with an error (-1: never)",
    )
    counting_exit_token: int = Field(
        -1,
        ge=-1,
        description="with --model_dir counting, for tests only: a forward whose input holds this token id "
        "ends the worker process at once (os._exit, no clean-up, as a crash of native code) (-1: never)",
    )
    eos_id: list[int] | None = Field(
        None,
        description="token ids that end a request (LightLLM's --eos_id; default: the model's config and tokenizer)",
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="port of this service's Prometheus /metrics (0: none; when taken, the next free port above it)",
    )


class RqWorkerSettings(BaseSettings):
    """``lightq rq-worker``: runs batch jobs and the periodic housekeeping."""

    model_config = _frozen("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    housekeeping: HousekeepingSettings = Field(default_factory=HousekeepingSettings)


class ServeSettings(BaseSettings):
    """``lightq serve`` only: where its embedded Redis keeps its data."""

    model_config = _frozen("LIGHTQ_")
    data_dir: str = Field(
        "",
        description="directory of the embedded Redis's append-only files (default: "
        "~/.cache/lightq/redis/port-<port>; with an explicit --redis_url that does not "
        "answer, a temporary one removed on exit)",
    )
