"""The producer's settings (``lightq producer``), composed from the common parts in ``shared.config``."""

from __future__ import annotations

import ipaddress

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings

from shared.config import BatchSettings, ModelSettings, RedisSettings, frozen_settings, usable_cores


def default_producers() -> int:
    """One producer process per 4 cores this process may use, at most 4, at least 1.

    The producer shares the host with Redis, the router and the workers' host
    threads, so it gets a quarter of the cores. One process carried ~5,000
    tok/s of /generate at ~110% CPU on an H200 host (issue 13); four carry more
    than one GPU delivers. A 2-core machine gets 1, as before.
    """
    return min(4, max(1, usable_cores() // 4))


def api_key_entries(api_keys: str, flag: str = "--api_keys") -> list[tuple[str | None, str]]:
    """``--api_keys`` as (tenant, key): comma-separated, each ``KEY`` or ``TENANT:KEY`` (split at the
    first ':'; a key of its own holding ':' needs a tenant before it); blank items and spaces ignored.
    ValueError for an item with a tenant and no key, or a setting that is not blank and holds no key:
    either is a list whose keys did not get there (an unset ``$KEY`` in it), and taking it as "no keys"
    would have served everyone without one."""
    out: list[tuple[str | None, str]] = []
    for item in api_keys.split(","):
        tenant, sep, key = item.strip().partition(":")
        if sep and not key.strip():
            raise ValueError(f"{flag}: {item.strip()!r} names a tenant and no key")
        if tenant.strip() or key.strip():
            out.append((tenant.strip() or None, key.strip()) if sep else (None, tenant.strip()))
    if api_keys.strip() and not out:
        raise ValueError(f"{flag} is set but holds no key (leave it unset to run without keys)")
    return out


class ProducerSettings(BaseSettings):
    model_config = frozen_settings("LIGHTQ_")
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
    admin_api_keys: SecretStr = Field(
        SecretStr(""),
        description="comma-separated API keys (KEY or TENANT:KEY, as --api_keys) that may also use the "
        "operator's routes: loading and unloading LoRA adapters for the whole pool, /metrics and the "
        "dashboard (every tenant's names and counts); with keys on, any other key gets 403 there",
    )
    rate_limit_rpm: int = Field(
        0, ge=0, description="requests (POSTs) per minute per API key; 429 past it (0: no limit)"
    )

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _keys_parse(cls, value: SecretStr, info: ValidationInfo) -> SecretStr:
        # A list that holds no key is refused at start.
        api_key_entries(value.get_secret_value(), f"--{info.field_name}")
        return value

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

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _proxies_parse(cls, value: str) -> str:
        """Each an address or network, or '*': uvicorn takes any other word as a literal that no
        client address matches, so a typo silently trusted no proxy at all."""
        for item in (part.strip() for part in value.split(",")):
            if item and item != "*":
                try:
                    ipaddress.ip_network(item, strict=False)
                except ValueError:
                    raise ValueError(f"--forwarded_allow_ips: {item!r} is not an address or network") from None
        return value

    metrics_tenants: int = Field(
        16,
        ge=0,
        description="tenants per priority class with /metrics series of their own (the most queued, the "
        "most tokens dispatched); the rest are tenant 'other'",
    )
    batch: BatchSettings = Field(default_factory=BatchSettings)
