"""``lightq worker``: load the model, size the pool, serve the inbox."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from shared.admission import AdmissionRule
from shared.config import WorkerSettings
from shared.keys import Keys
from shared.model_files import load_tokenizer, resolve
from shared.redis import sync_client
from shared.service import default_id, setup_logging, stop_on_signals
from worker.counting_model import CountingModel
from worker.cuda_graphs import DecodeGraphs, default_buckets
from worker.engine import Engine, EngineLimits
from worker.kv_cache import KVCache
from worker.loader import attach_kv_cache, load_model
from worker.metrics import MeteredEngine, WorkerCollector, WorkerMetrics, serve_metrics
from worker.model_runner import ModelRunner
from worker.req_table import ReqTable
from worker.serve import WorkerService
from worker.token_pool import TokenPool

log = logging.getLogger("lightq.worker")

CPU_POOL_TOKENS = 8192
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def eos_ids(config, tokenizer) -> set[int]:
    """The config's EOS ids plus the tokenizer's (chat models often differ)."""
    ids = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return {i for i in [*ids, getattr(tokenizer, "eos_token_id", None)] if i is not None}


def pool_size(settings: WorkerSettings, model, device: torch.device) -> int:
    """``--max_total_token_num`` if given; on a GPU, what ``--mem_fraction`` of
    its memory leaves after the weights (LightLLM's rule); 8192 on a CPU."""
    if settings.max_total_token_num is not None:
        return settings.max_total_token_num
    if device.type != "cuda":
        return CPU_POOL_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    usable = free - total * (1 - settings.mem_fraction)
    per_token = KVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    if usable < per_token * settings.model.max_req_total_len:
        raise RuntimeError(f"only {usable / 2**30:.1f} GiB left for the KV pool after the weights: "
                           f"raise --mem_fraction or use a smaller model")
    return int(usable // per_token)


def load_model_or_stand_in(settings: WorkerSettings, tokenizer, dtype: torch.dtype, device: torch.device):
    """The model and its config; ``counting`` gives the deterministic test stand-in."""
    source = resolve(settings.model.model_dir)
    if source.kind != "counting":
        return load_model(source, dtype, device, seed=settings.seed)
    vocab = len(tokenizer) if tokenizer is not None else 49152
    return CountingModel(vocab, device), SimpleNamespace(vocab_size=vocab, eos_token_id=None)


def build_engine(settings: WorkerSettings, tokenizer=None) -> Engine:
    """Model, pool, table, graphs and engine; ``tokenizer`` only adds its EOS id."""
    if settings.tp != 1:
        raise ValueError(f"--tp {settings.tp} is not supported yet; only --tp 1")
    device = pick_device(settings.device)
    dtype = pick_dtype(settings.dtype, device)
    model, config = load_model_or_stand_in(settings, tokenizer, dtype, device)
    num_slots = pool_size(settings, model, device)
    cache = attach_kv_cache(model, num_slots, device)
    log.info("model on %s (%s), KV pool %d tokens (%.1f GiB)", device, dtype, num_slots,
             cache.buffer.numel() * cache.buffer.element_size() / 2**30)
    table = ReqTable(settings.running_max_req_size, settings.model.max_req_total_len + 8, cache.hold_slot, device)
    graphs = None
    if device.type == "cuda" and settings.cuda_graphs:
        buckets = default_buckets(min(settings.graph_max_batch_size, settings.running_max_req_size))
        graphs = DecodeGraphs(model, table, cache.hold_slot, config.vocab_size, buckets, device)
    eos = eos_ids(config, tokenizer)
    runner = ModelRunner(model, TokenPool(num_slots), table, config.vocab_size, device, eos, graphs)
    limits = EngineLimits(num_slots, settings.batch_max_tokens, settings.running_max_req_size)
    return Engine(runner, limits, eos, AdmissionRule(settings.past_future))


def run(settings: WorkerSettings) -> None:
    setup_logging()
    worker_id = default_id(settings.worker_id)
    tokenizer = load_tokenizer(resolve(settings.model.model_dir))
    engine = build_engine(settings, tokenizer)
    client = sync_client(settings.redis)
    metrics = WorkerMetrics(worker_id)
    metrics.registry.register(WorkerCollector(engine, client, Keys(settings.redis.key_prefix), worker_id))
    server = serve_metrics(metrics.registry, settings.metrics_port)
    service = WorkerService(settings, client, MeteredEngine(engine, metrics), tokenizer, worker_id)
    stop_on_signals(service.stop_event)
    try:
        service.run()
    finally:
        if server is not None:
            server.shutdown()
        client.close()


def main() -> None:
    run(WorkerSettings())


if __name__ == "__main__":
    main()
