"""Typed, frozen settings: one object per process, built once in its main().

Every field can be set from the environment (prefix ``LIGHTQ_``) or from a
command-line flag of the same name (``--max_total_token_num``), which keeps
LightLLM's flag names where they mean the same thing. Common parts are
separate classes composed into each service's settings, never inherited.

The producer's and the worker's own settings are in ``shared.producer_settings`` and
``shared.worker_settings``.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.keys import Keys

# How often the router and the worker look up the cancel keys of the requests they hold: a cancel
# waits at most this long to be seen (a lookup is one round trip for every request held).
CANCEL_CHECK_S = 0.05


def frozen_settings(prefix: str) -> SettingsConfigDict:
    """Every settings class's config: read from ``prefix``-ed variables, frozen once built (one
    settings object per process, never changed), other variables ignored."""
    return SettingsConfigDict(env_prefix=prefix, frozen=True, extra="ignore", protected_namespaces=())


class RedisSettings(BaseSettings):
    """Where Redis is and which key namespace this deployment owns."""

    model_config = frozen_settings("LIGHTQ_REDIS_")
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        pattern=r"^(redis|rediss|unix|redis\+cluster|rediss\+cluster)://",
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


def default_weights_cache() -> str:
    """``$XDG_CACHE_HOME/lightq/weights``, or under ``~/.cache`` (the XDG default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightq", "weights")


class ModelSettings(BaseSettings):
    """Which model is served and the request-length limit all services agree on."""

    model_config = frozen_settings("LIGHTQ_")
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

    # Here, not the worker's alone: every process that serves a GGUF reads its config or tokenizer from here.
    weights_cache: str = Field(
        default_weights_cache(),
        description="folder where a .gguf's dequantised weights (fp32 safetensors), config and tokenizer are "
        "kept, one of each per GGUF, so later starts skip building them ('': never kept)",
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

    model_config = frozen_settings("LIGHTQ_BATCH_")
    queue: str = Field("lightq-batch", description="rq queue of batch jobs")
    max_in_flight: int = Field(32, gt=0, description="requests of one batch in the pool at once")
    max_requests: int = Field(50_000, gt=0, description="most lines in one batch file")
    ttl_s: int = Field(7 * 86_400, gt=0, description="seconds a batch's records (input, output) stay readable")
    job_timeout_s: int = Field(86_400, gt=0, description="longest a batch job may run")
    retries: int = Field(2, ge=0, description="restarts of an interrupted batch job (it resumes where it was)")


class HousekeepingSettings(BaseSettings):
    """rq's periodic janitor: trims the ingress stream, sweeps leftover records, drops dead workers."""

    model_config = frozen_settings("LIGHTQ_HOUSEKEEPING_")
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


PolicyName = Literal["conservative", "aggressive", "past_future", "past_future_quantile"]  # shared.admission.POLICIES


class AdmissionSettings(BaseSettings):
    """The admission rule; router and worker apply the same one (shared.admission)."""

    model_config = frozen_settings("LIGHTQ_")
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
    model_config = frozen_settings("LIGHTQ_")
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
    # router.order.ordering: priorities and fair shares apply to what a router holds, so it holds up to this many.
    order_window: int = Field(
        1024,
        gt=0,
        description="queued requests of each priority class a router holds to order (by tenant), at most a "
        "quarter of them one tenant's: it reads on past a tenant's flood, parking the rest",
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
        "the recompute costs throughput); a worker given it too pauses so for a better class sent to it without "
        "an ask, on a record older than its work (lightq serve gives it to both)",
    )


class RqWorkerSettings(BaseSettings):
    """``lightq rq-worker``: runs batch jobs and the periodic housekeeping."""

    model_config = frozen_settings("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    housekeeping: HousekeepingSettings = Field(default_factory=HousekeepingSettings)


class ServeSettings(BaseSettings):
    """``lightq serve`` only: where its embedded Redis keeps its data."""

    model_config = frozen_settings("LIGHTQ_")
    data_dir: str = Field(
        "",
        description="directory of the embedded Redis's append-only files (default: "
        "~/.cache/lightq/redis/port-<port>; with an explicit --redis_url that does not "
        "answer, a temporary one removed on exit)",
    )
