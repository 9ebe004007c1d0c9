"""The FP8 small-batch matmuls against their weight-read floor, by tile (issue 31).

    python3 -m bench.engine.fp8_gemv --model-shape llama3-8b

For each FP8 linear of one Llama decoder layer at M rows (M <= 16: a decode step of a
few requests), times lightq's W8A16 GEMV (``worker/model/kernels/gemv.py``) over a grid
of tiles, against ``torch._scaled_mm`` on x padded to 16 rows (W8A8, x quantised per token first,
as the large-batch path does) and bf16 cuBLAS. Each timed config is first checked against
an fp32 product of the same FP8 values on a poisoned output, with ordinary inputs and with
inputs 1,000 times smaller. (Commit 4bc7507 also timed two other ways of turning an FP8
weight tile into a tl.dot operand, fp16 dots and a bit shuffle into bf16: 3% at most, not
kept; bench/RESULTS.md.) Timing: 32 calls in a
CUDA graph, each on a different copy of the weight (>= 1 GiB in all, so nothing is in L2),
median of 30 replays. Prints a row per layer and M, then one line: the summed time of the
four linears as a share of the FP8 weight-read floor, default config against best.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from bench.engine.decode_step import copy_bandwidth, time_cuda
from bench.engine.gemv import graphed, layer_shapes
from worker.model.kernels.fp8_quant import quantize_rows as quantize_activations
from worker.model.kernels.gemv import GemvConfig, fp8_config, gemv
from worker.model.quant import quantize_rows

COPIES_BYTES = 1 << 30
CALLS = 32


class Shape:
    """One linear's FP8 weight copies and a row block of inputs."""

    def __init__(self, out_features: int, in_features: int):
        self.n, self.k = out_features, in_features
        copies = max(2, COPIES_BYTES // (out_features * in_features))
        self.weights = []
        for _ in range(copies):
            w, s = quantize_rows(torch.randn(out_features, in_features, device="cuda") / in_features**0.5)
            self.weights.append((w, s))
        self.x = torch.randn(16, in_features, device="cuda", dtype=torch.bfloat16)

    def check(self, m: int, config: GemvConfig) -> None:
        w, s = self.weights[0]
        for size in (1.0, 1e-3):
            x = self.x[:m] * size
            want = (x.float() @ w.float().T) * s[None, :]
            out = torch.full((m, self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemv(x, w, None, config, out=out, weight_scale=s)
            torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)

    def seconds(self, fn) -> float:
        run = lambda: [fn(*self.weights[i % len(self.weights)]) for i in range(CALLS)]  # noqa: E731
        return statistics.median(time_cuda(graphed(run), repeat=30, warmup=3)) / CALLS

    def gemv_time(self, m: int, config: GemvConfig) -> float:
        x = self.x[:m]
        return self.seconds(lambda w, s: gemv(x, w, None, config, weight_scale=s))

    def scaled_mm_time(self, m: int) -> float:
        x = torch.zeros(16, self.k, device="cuda", dtype=torch.bfloat16)
        x[:m] = self.x[:m]

        def call(w, s):
            xq, xs = quantize_activations(x)
            torch._scaled_mm(xq, w.T, scale_a=xs[:, None], scale_b=s[None, :], out_dtype=torch.bfloat16)

        return self.seconds(call)

    def bf16_time(self, m: int) -> float:
        w = torch.randn(self.n, self.k, device="cuda", dtype=torch.bfloat16)
        x = self.x[:m]
        return self.seconds(lambda _w, _s: F.linear(x, w))  # one weight: an under-estimate (L2), a reference


GRID = [GemvConfig(n, k, s, w) for n, k, s, w in itertools.product((32, 64, 128), (256, 512), (1, 2, 4, 8), (4, 8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--rows", default="1,8")
    args = parser.parse_args()
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bandwidth / 1e12:.2f} TB/s, {num_sms} SMs")
    rows = [int(r) for r in args.rows.split(",")]
    totals: dict[str, float] = {}
    for name, n, k in layer_shapes(args.model_shape)[:4]:  # the LM head stays bf16
        shape = Shape(n, k)
        floor = n * k / bandwidth
        for m in rows:
            line = f"{name:<13} {n:>6}x{k:<6} M={m:>2} floor {floor * 1e6:6.1f} us"
            line += f" | bf16 cuBLAS {shape.bf16_time(m) * 1e6:6.1f} | scaled_mm {shape.scaled_mm_time(m) * 1e6:6.1f}"
            default = fp8_config(n, k, num_sms)
            shape.check(m, default)
            t = shape.gemv_time(m, default)
            totals[f"default M={m}"] = totals.get(f"default M={m}", 0.0) + t
            line += f" | default {t * 1e6:6.1f} ({floor / t:.2f})"
            times = {}
            for config in GRID:
                try:
                    shape.check(m, config)
                except Exception as error:  # noqa: BLE001 -- a wrong tile, or one over shared memory, is not timed
                    print(f"  {name} M={m} {config}: {str(error).splitlines()[0][:100]}")
                    continue
                times[config] = shape.gemv_time(m, config)
            best = min(times, key=times.get)
            totals[f"best M={m}"] = totals.get(f"best M={m}", 0.0) + times[best]
            label = f"n{best.block_n} k{best.block_k} s{best.split_k} w{best.num_warps}"
            line += f" | best {times[best] * 1e6:6.1f} ({floor / times[best]:.2f}) {label}"
            print(line, flush=True)
        totals["floor"] = totals.get("floor", 0.0) + floor
        del shape
        torch.cuda.empty_cache()
    summary = ", ".join(f"{key} {totals['floor'] / t:.2f}" for key, t in totals.items() if key != "floor")
    print(f"fp8_gemv {args.model_shape}: share of the FP8 weight-read floor, four linears summed: {summary}")


if __name__ == "__main__":
    main()
