"""The model worker's settings (``lightq worker``), composed from the common parts in ``shared.config``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings

from shared.config import AdmissionSettings, ModelSettings, RedisSettings, frozen_settings, usable_cores

# Chunk runs (worker.service.pending): a request's tokens are written together at most this often,
# so a token costs Redis a share of one entry, not an entry of its own (bench/serving/redis_cost.py).
STREAM_FLUSH_MS = 50.0


def default_publishers() -> int:
    """Publisher processes per worker: one keeps up with ~25,000 tokens/s on average, but an H200
    at batch 1,000 makes 1,000 tokens per ~25 ms step, more than one process writes in that time
    (issue 13); hosts with 16 cores or more can spare a second."""
    return 2 if usable_cores() >= 16 else 1


class WorkerSettings(BaseSettings):
    model_config = frozen_settings("LIGHTQ_")
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    worker_id: str = Field("", description="unique worker id (default: host-pid)")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:N]'")
    dtype: str = Field(
        "auto",
        description="'auto' (bf16 on a GPU and on a CPU with native bf16: AVX-512 BF16 or AMX; else fp32), "
        "'float32', 'float16', 'bfloat16'",
    )
    quantization: Literal["none", "fp8", "fp8_w8a16"] = Field(
        "none",
        description="'fp8': the linear layers' weights (per output channel) and inputs (per token) in FP8 e4m3, "
        "quantised at load; 'fp8_w8a16': the weights alone in FP8, the inputs in the model dtype (more "
        "accurate; large batches run at the model dtype's matmul rate); a checkpoint published in FP8 "
        "(quantization_config 'fp8' or compressed-tensors 'float-quantized') loads as FP8 whatever this says, "
        "its inputs as this says",
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
    publisher_stall_s: float = Field(
        20.0,
        gt=0,
        description="seconds a publisher process may leave steps it was sent unwritten, while Redis answers, "
        "before it is taken for stuck (frozen, or hung on a dead connection): it is killed and the worker "
        "hands its requests back and exits, as when a publisher dies",
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
    preempt: bool = Field(
        False,
        description="pause requests of a worse priority class here for a better one that arrived without a "
        "router's ask and does not fit (the router's --preempt, which lightq serve passes to both; a router "
        "decides on load records that may be older than the work they describe)",
    )
    max_preemptions: int = Field(
        2, ge=0, description="times a request may be paused for a better priority class (router --preempt)"
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
    lora_page_batch: int = Field(
        8,
        ge=1,
        description="once every --max_loras slot is held by running requests, page adapters in again only when "
        "this many slots are free, so the waiting requests start together in one prefill step rather than one "
        "a step (1: page in as each slot frees)",
    )
    lora_prefetch: int = Field(
        0,
        ge=0,
        le=1024,
        description="on a GPU, how many adapters of requests waiting for a --max_loras slot are copied ahead "
        "(host to device, beside the running steps) into staging buffers of one adapter at --max_lora_rank each, "
        "allocated at start, so their page-ins need no copy from the host (0: as many as --lora_page_batch)",
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
