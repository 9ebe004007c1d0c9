"""``lightq worker``: load the model, size the pool, serve the inbox.

With ``--tp N`` the worker is N processes (``worker.runner.tp``): this one is rank 0
and serves; ranks 1..N-1 (``follower``) load their slice and run its forwards.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Sequence
from types import SimpleNamespace

import torch

from shared.admission import AdmissionRule
from shared.flags import from_argv
from shared.metrics_server import serve_metrics
from shared.model_files import load_config, load_tokenizer, resolve
from shared.redis import sync_client, wait_until_up
from shared.service import default_id, setup_logging, stop_on_signals
from shared.worker_settings import WorkerSettings
from worker.engine.engine import Engine, EngineLimits
from worker.engine.radix_cache import RadixCache
from worker.engine.token_pool import TokenPool
from worker.lora.adapter_set import check_adapters, load_adapters
from worker.model.counting_model import COUNTING_VOCAB, CountingModel, Crash
from worker.model.kv_cache import KVCache, kv_storage_dtype
from worker.model.layers import SINGLE, TensorParallel, native_bf16
from worker.model.loader import attach_kv_cache, load_model
from worker.model.models import model_class
from worker.runner import tp as tensor_parallel
from worker.runner.cuda_graphs import DecodeGraphs, default_buckets
from worker.runner.grammar import Grammars
from worker.runner.grammar_cache import GrammarCache
from worker.runner.model_runner import ModelRunner
from worker.runner.prefill_graphs import PrefillGraphs
from worker.runner.req_table import ReqTable
from worker.service.metrics import MeteredService, WorkerCollector, WorkerMetrics
from worker.service.publisher_process import PublisherDied, PublisherLink

# The model loop's share of the GIL: see run_service.
GIL_SWITCH_S = 0.0005

log = logging.getLogger("lightq.worker")

CPU_POOL_TOKENS = 8192
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def rank_device(settings: WorkerSettings, rank: int) -> torch.device:
    """Rank r of a tensor-parallel worker on CUDA uses the r-th GPU from ``--device``'s (0 by default)."""
    device = pick_device(settings.device)
    if settings.tp == 1 or device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_tp(settings: WorkerSettings) -> None:
    """``--tp N``: N splits the model's heads, KV heads, MLP and vocabulary evenly; on CUDA, N GPUs exist."""
    n = settings.tp
    if n < 1:
        raise ValueError(f"--tp must be at least 1, not {n}")
    if n == 1:
        return
    source = resolve(settings.model.model_dir)
    if source.kind == "counting":
        raise ValueError("--tp above 1 needs a real model, not the counting stand-in")
    config = load_config(source, settings.model.weights_cache)
    try:  # the model checks every split it makes; on the meta device that costs no memory
        model_class(config)(config, dtype=torch.float32, device="meta", tp=TensorParallel(0, n))
    except ValueError as exc:
        raise ValueError(f"--tp {n} does not fit {settings.model.model_dir}: {exc}") from None
    device = pick_device(settings.device)
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + n > count:
            raise ValueError(f"--tp {n} on {device} needs GPUs {first}..{first + n - 1}; {count} visible")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``--dtype``; 'auto': bf16 on a GPU and on a CPU that runs bf16 natively (AVX-512 BF16 or AMX:
    the embedded SmolLM2 serves ~1.5x faster there, at perplexity +0.17% and mean KL 0.0014 against
    fp32, bench/RESULTS.md), fp32 on other CPUs (where bf16 is emulated, at a seventh of fp32's rate
    on the old AVX2 sandbox)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or native_bf16() else torch.float32
    return DTYPES[name]


def eos_ids(config, tokenizer) -> set[int]:
    """The config's EOS ids plus the tokenizer's (chat models often differ)."""
    ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return {i for i in [*ids, getattr(tokenizer, "eos_token_id", None)] if i is not None}


def pool_size(settings: WorkerSettings, model, device: torch.device) -> int:
    """``--max_total_token_num`` if given; on a GPU, what ``--mem_fraction`` of
    its memory leaves after the weights (LightLLM's rule); 8192 on a CPU.

    A worker sharing its GPU (``--gpu_share`` below 1) takes its share of
    ``--mem_fraction`` less its own weights, and never more than is free now
    less the headroom: its neighbours may be loading at the same moment, so
    free memory alone would let the first to measure take it all."""
    if settings.max_total_token_num is not None:
        return settings.max_total_token_num
    if device.type != "cuda":
        return CPU_POOL_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    usable = free - total * (1 - settings.mem_fraction)
    if settings.gpu_share < 1:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        usable = min(usable, total * settings.mem_fraction * settings.gpu_share - weights)
    kv_dtype = kv_storage_dtype(model.dtype, settings.kv_cache_dtype)  # FP8: about half the bytes a token
    per_token = KVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype)
    if usable < per_token * settings.model.max_req_total_len:
        raise RuntimeError(
            f"only {usable / 2**30:.1f} GiB left for the KV pool after the weights: "
            f"raise --mem_fraction or use a smaller model"
        )
    return int(usable // per_token)


def load_model_or_stand_in(
    settings: WorkerSettings, tokenizer, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
):
    """The model (this rank's slice) and its config; ``counting`` gives the deterministic test stand-in."""
    source = resolve(settings.model.model_dir)
    if source.kind != "counting":
        return load_model(
            source,
            dtype,
            device,
            seed=settings.seed,
            tp=tp,
            weights_cache=settings.model.weights_cache,
            quantization=settings.quantization,
        )
    vocab = min(len(tokenizer), COUNTING_VOCAB) if tokenizer is not None else COUNTING_VOCAB
    crash = Crash(settings.counting_raise_token, settings.counting_exit_token)  # tests' fault injection
    model = CountingModel(vocab, device, settings.counting_step_ms / 1000, crash)
    return model, SimpleNamespace(vocab_size=vocab, eos_token_id=None)


def build_runner(settings: WorkerSettings, tokenizer=None, group=None) -> tuple[ModelRunner, set[int]]:
    """Model, pool, table and graphs of this rank (``group``: a ``worker.runner.tp.TPGroup``, None for --tp 1),
    and the EOS ids; ``tokenizer`` only adds its EOS id. Every rank builds the same, in the same order."""
    size, rank = (group.size, group.rank) if group is not None else (1, 0)
    if size != settings.tp:
        raise ValueError(
            f"--tp {settings.tp} needs a process group of {settings.tp} (worker.runner.tp.launch), not {size}"
        )
    device = rank_device(settings, rank)
    dtype = pick_dtype(settings.dtype, device)
    model, config = load_model_or_stand_in(settings, tokenizer, dtype, device, group.tp if group else SINGLE)
    if settings.model.lora_modules or settings.max_loras:  # before the pool is sized: the stacks come first
        attach_adapters(settings, model)
    num_slots, cache = attach_pool(settings, model, device, dtype, rank, group)
    table = ReqTable(settings.running_max_req_size, settings.model.max_req_total_len + 8, cache.hold_slot, device)
    graphs, prefill_graphs = capture_graphs(settings, model, table, cache.hold_slot, config.vocab_size, device)
    eos = set(settings.eos_id) if settings.eos_id else eos_ids(config, tokenizer)  # --eos_id replaces them
    grammars = grammars_for(settings, tokenizer, config.vocab_size, eos)
    pool = TokenPool(num_slots)
    prefix_cache = RadixCache(pool) if settings.prefix_cache else None  # rank 0's decides; followers' stay empty
    runner = ModelRunner(
        model, pool, table, config.vocab_size, device, eos, graphs, prefill_graphs, grammars, prefix_cache
    )
    if group is not None and rank == 0:
        runner.on_forward = group.send_step  # each forward runs on the followers too
    return runner, eos


def attach_adapters(settings: WorkerSettings, model) -> None:
    """``--lora_modules``' adapters and ``--max_loras``' run-time slots, installed in the model."""
    adapters = load_adapters(
        settings.model.lora_modules,
        model,
        settings.model.max_lora_rank,
        settings.max_loras,
        settings.lora_page_batch,
        settings.lora_prefetch,
    )
    log.info(
        "LoRA adapters %s and %d run-time slots: rank <= %d, %.1f MiB",
        adapters.names,
        settings.max_loras,
        adapters.max_rank,
        adapters.nbytes / 2**20,
    )


def attach_pool(
    settings: WorkerSettings, model, device: torch.device, dtype: torch.dtype, rank: int, group=None
) -> tuple[int, KVCache]:
    """The KV pool's size in tokens (the same on every rank) and the cache attached to the model."""
    num_slots = pool_size(settings, model, device)
    if group is not None:
        num_slots = group.min(num_slots)  # every rank's pool the same size: the smallest that fits
    cache = attach_kv_cache(model, num_slots, device, kv_storage_dtype(dtype, settings.kv_cache_dtype))
    log.info(
        "rank %d: model on %s (%s%s), KV pool %d tokens (%.1f GiB, %s)",
        rank,
        device,
        dtype,
        {"fp8": ", FP8 linear layers", "fp8_w8a16": ", FP8 linear weights (W8A16)"}.get(settings.quantization, ""),
        num_slots,
        cache.nbytes / 2**30,
        cache.buffer.dtype,
    )
    return num_slots, cache


def capture_graphs(
    settings: WorkerSettings, model, table: ReqTable, hold_slot: int, vocab_size: int, device: torch.device
) -> tuple[DecodeGraphs | None, PrefillGraphs | None]:
    """The CUDA graphs of decode steps and of small prefills; (None, None) on a CPU or with them off."""
    graphs = prefill_graphs = None
    if device.type == "cuda" and settings.cuda_graphs:  # the same buckets on every rank, collectives inside
        buckets = default_buckets(min(settings.graph_max_batch_size, settings.running_max_req_size))
        graphs = DecodeGraphs(model, table, hold_slot, vocab_size, buckets, device)
        if settings.tp == 1:  # small prefills too (measured on one GPU only)
            prefill_graphs = PrefillGraphs(model, table, hold_slot, vocab_size, device)
    return graphs, prefill_graphs


def grammars_for(settings: WorkerSettings, tokenizer, vocab_size: int, eos: set[int]) -> Grammars | None:
    """Constrained decoding, which needs the tokenizer's token texts (rank 0 samples; followers have none)."""
    if tokenizer is not None and len(tokenizer) <= vocab_size:
        return Grammars(GrammarCache.for_tokenizer(tokenizer, vocab_size, eos), settings.grammar_compile_timeout_s)
    return None


def build_engine(settings: WorkerSettings, tokenizer=None, group=None) -> Engine:
    """The engine on rank 0's runner (see ``build_runner``)."""
    runner, eos = build_runner(settings, tokenizer, group)
    limits = EngineLimits(runner.pool.num_slots, settings.batch_max_tokens, settings.running_max_req_size)
    # On a CPU a forward is done when its call returns: nothing to overlap. Tensor-parallel followers
    # take each decode's input ids from rank 0's host, which must have landed them.
    on_gpu = runner.device.type == "cuda"
    overlap = settings.tp == 1 and (settings.overlap == "on" or (settings.overlap == "auto" and on_gpu))
    return Engine(runner, limits, eos, AdmissionRule(settings.admission_rule), overlap=overlap)


def follower(rank: int, size: int, port: int, settings: WorkerSettings) -> None:
    """A tensor-parallel follower process (ranks 1..N-1): load its slice, then run rank 0's steps."""
    tensor_parallel.start_follower()
    setup_logging()
    group = tensor_parallel.init_rank(rank, size, port, rank_device(settings, rank))
    runner, _ = build_runner(settings, None, group)
    tensor_parallel.follow(group, runner)
    tensor_parallel.exit_now()


def run(settings: WorkerSettings) -> None:
    setup_logging()
    try:
        check_tp(settings)
        check_adapters(
            settings.model.lora_modules,
            settings.model.model_dir,
            settings.tp,
            settings.model.max_lora_rank,
            settings.max_loras,
            settings.model.weights_cache,
        )
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"lightq worker: {exc}")
    group = None
    if settings.tp > 1:
        group = tensor_parallel.launch(settings.tp, rank_device(settings, 0), follower, settings)
    try:
        run_service(settings, group)
    except BaseException:
        if group is not None:
            group.abort()
        raise
    if group is not None:
        group.close()
        tensor_parallel.exit_now()  # the group is never torn down: see worker.runner.tp.TPGroup.close


def run_service(settings: WorkerSettings, group=None) -> None:
    """Rank 0 (or the only rank): the engine behind the service loop, until a signal stops it."""
    worker_id = default_id(settings.worker_id)
    stop = threading.Event()
    stop_on_signals(stop)  # before the model loads: a worker scaled down while loading exits after it
    publisher = PublisherLink(settings, worker_id)
    publisher.start()  # it loads the tokenizer while the model loads here
    tokenizer = load_tokenizer(resolve(settings.model.model_dir), settings.model.weights_cache)
    engine = build_engine(settings, tokenizer, group)
    if stop.is_set():
        log.info("worker %s stopped while loading: never served", worker_id)
        publisher.close()
        return
    client = sync_client(settings.redis)
    if not wait_until_up(client, log, give_up=stop.is_set):
        log.info("worker %s stopped while Redis was unreachable: never served", worker_id)
        publisher.close()
        return
    metrics = WorkerMetrics(worker_id)
    metrics.registry.register(WorkerCollector(engine, client, settings.redis.keys, worker_id))
    server = serve_metrics(metrics.registry, settings.metrics_port)
    service = MeteredService(settings, client, engine, worker_id, publisher, metrics=metrics)
    service.stop_event = stop
    # The heartbeat thread shares the GIL with the model loop. Whenever the loop waits on the GPU
    # (the sampled ids' copy) the heartbeat may take the GIL, and by default the loop gets it back
    # only after 5 ms (the switch interval): up to 5 ms added to a step. (The publisher, which
    # did far more, is a process of its own: worker.service.publisher_process.)
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        service.run()
    except PublisherDied:
        sys.exit(f"lightq worker {worker_id}: its publisher process died; requests handed back")
    finally:
        if server is not None:
            server.shutdown()
        client.close()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m worker.main [flags]``: the flags ``lightq worker`` takes (``--help`` lists them)."""
    run(from_argv(WorkerSettings, "python -m worker.main", __doc__, argv))


if __name__ == "__main__":
    main()
