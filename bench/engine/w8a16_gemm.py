"""W8A16 above 16 rows: lightq's GEMM against the weight converted to bf16 and cuBLAS, and bf16 cuBLAS.

    python3 -m bench.engine.w8a16_gemm --model-shape llama3-8b --rows 32,138,742,4096

For each linear of one Llama decoder layer and each row count M (a decode step of M requests, or a
prefill chunk), times three ways to compute x W^T with x in bf16: bf16 cuBLAS on a bf16 copy of the
weight (the unquantised model: the peer), the FP8 weight converted to bf16 each call then cuBLAS and
the column scales (what ``--quantization fp8_w8a16`` did above 16 rows before ``kernels/w8a16_gemm.py``),
and ``w8a16_matmul`` (FP8 tiles converted in registers). lightq's output is checked first against an
fp32 product of the same FP8 values, on a NaN-poisoned output. Timing: CUDA events, median of 30 runs
after warm-up, one copy of each weight (at a few rows the smaller weights may sit in L2 for every way).
One line per (linear, M), then the four linears summed per M and the ratio to bf16.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.engine.decode_step import time_cuda
from bench.engine.gemv import layer_shapes
from worker.model.kernels.w8a16_gemm import w8a16_matmul
from worker.model.quant import quantize_rows


def converted(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype)).mul_(s.to(x.dtype))


def measure(n: int, k: int, m: int) -> dict[str, float]:
    w, s = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
    w16 = (w.float() * s[:, None]).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    w8a16_matmul(x, w, s, out=out)
    want = (x.float() @ w.float().T) * s[None, :]
    torch.testing.assert_close(out.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
    ways = {
        "bf16 cuBLAS": lambda: F.linear(x, w16),
        "converted + cuBLAS": lambda: converted(x, w, s),
        "lightq W8A16 GEMM": lambda: w8a16_matmul(x, w, s),
    }
    return {name: statistics.median(time_cuda(fn, repeat=30, warmup=3)) * 1e6 for name, fn in ways.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--rows", default="32,138,742,4096")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [(name, n, k) for name, n, k in layer_shapes(args.model_shape) if name != "lm_head"]
    totals: dict[int, dict[str, float]] = {m: {} for m in rows}
    print(f"{'linear':<14}{'M':>6}  {'bf16 cuBLAS µs':>15}{'converted + cuBLAS':>20}{'lightq W8A16 µs':>17}")
    for name, n, k in shapes:
        for m in rows:
            times = measure(n, k, m)
            for way, t in times.items():
                totals[m][way] = totals[m].get(way, 0.0) + t
            print(f"{name:<14}{m:>6}  " + "".join(f"{t:>17.1f}" for t in times.values()))
    for m in rows:
        t = totals[m]
        print(
            f"w8a16_gemm {args.model_shape} M={m}: a layer's four linears bf16 {t['bf16 cuBLAS']:.0f} µs, "
            f"converted {t['converted + cuBLAS']:.0f} µs ({t['converted + cuBLAS'] / t['bf16 cuBLAS']:.2f}x), "
            f"lightq {t['lightq W8A16 GEMM']:.0f} µs ({t['lightq W8A16 GEMM'] / t['bf16 cuBLAS']:.2f}x of bf16)"
        )


if __name__ == "__main__":
    main()
