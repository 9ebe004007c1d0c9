"""One decode step against its memory-bandwidth floor.

    python bench/engine/decode_step.py --model-shape llama3-8b [--quantization fp8] [--kv-cache-dtype fp8_e4m3]

For batch 1, 64 and 256 at context 512 (random KV in the pool, scattered
slots), times a decode step replayed as a CUDA graph and eagerly (CUDA
events, median of many after warm-up), next to the floor: the bytes a step
must read (weights except the embedding, plus every cached K/V) over the
device-to-device copy bandwidth measured in the same run. With ``--quantization
fp8`` the linear layers' weights are FP8 (1 byte each, plus a scale per output
channel) and with ``--kv-cache-dtype fp8_e4m3`` the pool is (1 byte per value
plus a scale per token and head): the floor counts the bytes as stored.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

from bench.engine.shapes import SHAPES, config_dir
from shared.model_files import ModelSource
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache, kv_storage_dtype
from worker.model.loader import attach_kv_cache, load_model
from worker.model.quant import quantize_rows
from worker.runner.cuda_graphs import DecodeGraphs
from worker.runner.req_table import ReqTable


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = time_cuda(lambda: dst.copy_(src), repeat=20)
    return 2 * nbytes / statistics.median(times)


def time_cuda(fn, repeat: int = 50, warmup: int = 5) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1000)
    return out


def setup(shape: str, batches: list[int], context: int, quantization: str = "none", kv_cache_dtype: str = "auto"):
    source = ModelSource("dummy", config_dir(shape))
    model, config = load_model(source, torch.bfloat16, "cuda", quantization=quantization)
    slots_needed = max(batches) * (context + 1) + 1
    cache = attach_kv_cache(model, slots_needed, "cuda", kv_storage_dtype(torch.bfloat16, kv_cache_dtype))
    fill_random(cache)  # never benchmark on zeros
    table = ReqTable(max(batches), context + 8, cache.hold_slot, "cuda")
    perm = torch.randperm(slots_needed - 1, device="cuda").to(torch.int32)  # scattered slots
    table.table[: max(batches), :context] = perm[: max(batches) * context].view(max(batches), context)
    graphs = DecodeGraphs(model, table, cache.hold_slot, config.vocab_size, batches, torch.device("cuda"))
    return model, config, cache, table, graphs, perm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--quantization", choices=["none", "fp8", "fp8_w8a16"], default="none")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    model, config, cache, table, graphs, perm = setup(
        args.model_shape, batches, args.context, args.quantization, args.kv_cache_dtype
    )
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    per_token = KVCache.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, cache.buffer.dtype)
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; weights read per step {weight_bytes / 1e9:.2f} GB "
        f"(quantization {args.quantization}); KV {per_token / 1024:.1f} KiB a token ({args.kv_cache_dtype}), "
        f"context {args.context}"
    )
    print(f"{'batch':>5} {'graph ms':>9} {'eager ms':>9} {'floor ms':>9} {'graph/floor':>11} {'tok/s':>9}")
    for b in batches:
        rng = np.random.default_rng(b)
        ids = rng.integers(3, config.vocab_size, size=b)
        positions = np.full(b, args.context)
        slots = (
            perm[b * args.context : b * args.context + b].long().cpu().numpy()
            if b * (args.context + 1) <= len(perm)
            else np.arange(b)
        )
        rows = np.arange(b)
        step = (ids, positions, slots, rows)  # bound now: the closures below run within this pass
        graph_t = statistics.median(time_cuda(lambda step=step: graphs.run(*step)))
        eager_t = statistics.median(time_cuda(lambda step=step: model.forward(eager_batch(table, *step))))
        floor = (weight_bytes + b * (args.context + 1) * per_token) / bandwidth
        print(
            f"{b:>5} {graph_t * 1e3:>9.2f} {eager_t * 1e3:>9.2f} {floor * 1e3:>9.2f} {graph_t / floor:>11.2f} "
            f"{b / graph_t:>9,.0f}"
        )


def fill_random(cache: KVCache) -> None:
    """N(0, 1) K/V in every slot, 64K slots at a time (a long-context pool leaves little room for more);
    an FP8 pool quantised per token and head."""
    for layer in range(cache.num_layers):
        for start in range(0, cache.buffer.shape[1], 1 << 16):
            rows = cache.buffer[layer, start : start + (1 << 16)]
            values = torch.randn(rows.shape, device=rows.device)
            if cache.scales is None:
                rows.copy_(values)
            else:
                q, scale = quantize_rows(values)
                rows.copy_(q)
                cache.scales[layer, start : start + (1 << 16)] = scale


def eager_batch(table: ReqTable, ids, positions, slots, rows) -> ForwardBatch:
    dev = lambda x, dt=torch.int32: torch.as_tensor(np.asarray(x), device="cuda").to(dt)  # noqa: E731
    b = len(ids)
    table.write_scattered(rows, positions, slots)
    return ForwardBatch(
        input_ids=dev(ids, torch.int64),
        positions=dev(positions, torch.int64),
        out_slots=dev(slots, torch.int64),
        req_rows=dev(rows),
        cached_lens=dev(positions),
        seq_lens=dev(positions + 1),
        q_starts=dev(np.arange(b)),
        q_lens=dev(np.ones(b)),
        req_table=table.table,
        max_seq_len=int(positions.max()) + 1,
        max_q_len=1,
        is_decode=True,
    )


if __name__ == "__main__":
    main()
