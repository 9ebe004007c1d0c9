"""The decode step's matmuls at small batch against the weight-read floor (issue 16, item 2).

    python3 -m bench.engine.gemv --model-shape llama3-8b --batches 1,4,8,16,64

For each linear layer of one decoder layer (and the LM head) at M rows, times
``F.linear`` (cuBLAS) with CUDA events, median of many after warm-up, and puts
it next to the floor: the weight's bytes over the device-to-device copy
bandwidth measured in the same run. Each call reads a different copy of the
weight (copies totalling >= 1 GiB, cycled), so no call finds its weight in the
L2 cache, as a real step over 32 layers would not; 32 calls are captured in one CUDA graph and
its replays timed, as the decode step runs. Weights and inputs are
random normal (never zeros). At M <= 16 the same is timed for lightq's Triton
kernel (worker/model/kernels/gemv.py) with its default config and with the
best of a small grid of configs (checked against cuBLAS's result first).
Prints a table and one line: the time-weighted share of the floor for
M <= 16, cuBLAS against the kernel.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.engine.decode_step import copy_bandwidth, time_cuda
from bench.engine.shapes import SHAPES
from worker.model.kernels.gemv import MAX_ROWS, GemvConfig, default_config, gemv

COPIES_BYTES = 1 << 30


def layer_shapes(shape: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of one decoder layer's linears and the LM head."""
    c = SHAPES[shape]
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = hidden // heads
    return [
        ("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o_proj", hidden, heads * head_dim),
        ("gate_up_proj", 2 * c["intermediate_size"], hidden),
        ("down_proj", hidden, c["intermediate_size"]),
        ("lm_head", c["vocab_size"], hidden),
    ]


GRID = [GemvConfig(n, k, s) for n in (16, 32, 64) for k in (128, 256) for s in (1, 2, 4, 8, 16)]


def time_linear(
    out_features: int, in_features: int, m: int, calls: int = 32, config: GemvConfig | None = None
) -> float:
    """Median seconds of one x [m, in] @ W.T, W [out, in] bf16, a fresh copy of W each call.

    Timed as ``calls`` calls in one CUDA graph (as a step's 32 layers run), so the GPU is never
    idle waiting on the host's next launch: one call between two events measured the launch, not
    the kernel (5x the floor for a 4096x4096 weight), and Triton's launches cost more than cuBLAS's."""
    weight_bytes = out_features * in_features * 2
    copies = max(2, COPIES_BYTES // weight_bytes)
    weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, in_features, device="cuda", dtype=torch.bfloat16)

    if config is not None:  # the kernel must agree with cuBLAS before it is timed
        ref = F.linear(x, weights[0]).float()
        torch.testing.assert_close(gemv(x, weights[0], None, config).float(), ref, atol=0.5, rtol=2e-2)

    def run() -> None:
        for i in range(calls):
            if config is None:
                F.linear(x, weights[i % copies])
            else:
                gemv(x, weights[i % copies], None, config)

    return statistics.median(time_cuda(graphed(run), repeat=30, warmup=3)) / calls


def graphed(fn):
    """fn captured in a CUDA graph, as a decode step runs: a Triton launch from Python costs tens of
    microseconds of host time, more than a 4096x4096 weight read, and a graph replay none."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,4,8,16,64")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s")
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(
        f"{'layer':<13} {'out x in':>14} {'M':>4} {'cuBLAS ms':>9} {'floor ms':>9} {'floor/t':>7} "
        f"{'triton ms':>9} {'floor/t':>7} {'best ms':>8} {'best config':>22}"
    )
    small = {"floor": 0.0, "cublas": 0.0, "triton": 0.0, "best": 0.0}
    for name, out_features, in_features in layer_shapes(args.model_shape):
        floor = out_features * in_features * 2 / bandwidth
        default = default_config(out_features, in_features, num_sms)
        for m in batches:
            t = time_linear(out_features, in_features, m)
            shape = f"{out_features}x{in_features}"
            line = f"{name:<13} {shape:>14} {m:>4} {t * 1e3:>9.3f} {floor * 1e3:>9.3f} {floor / t:>7.2f}"
            if m <= MAX_ROWS:
                tt = time_linear(out_features, in_features, m, config=default)
                best_t, best = min((time_linear(out_features, in_features, m, config=c), c) for c in GRID)
                for key, value in (("floor", floor), ("cublas", t), ("triton", tt), ("best", best_t)):
                    small[key] += value
                label = f"n{best.block_n} k{best.block_k} s{best.split_k}"
                line += f" {tt * 1e3:>9.3f} {floor / tt:>7.2f} {best_t * 1e3:>8.3f} {label:>22}"
            print(line)
    print(
        f"gemv {args.model_shape} M<=16, share of the weight-read floor (time-weighted over the linears and LM head): "
        f"cuBLAS {small['floor'] / small['cublas']:.2f}, triton default {small['floor'] / small['triton']:.2f}, "
        f"triton best-of-grid {small['floor'] / small['best']:.2f} (copy bandwidth {bandwidth / 1e12:.2f} TB/s)"
    )


if __name__ == "__main__":
    main()
