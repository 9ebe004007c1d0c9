"""Sweep the W8A16 GEMM's configs at a few rows: the best per (linear, M) against the default and bf16.

    python3 -m bench.engine.w8a16_tune --model-shape llama3-8b --rows 32,64,138,256,742

For each linear of one Llama decoder layer (N, K from ``bench.engine.gemv.layer_shapes``) and each row
count M, times ``w8a16_matmul`` (worker/model/kernels/w8a16_gemm.py) over a grid of configs in two
phases: first the column tile (32 / 64 / 128; 64 / 128 swapped) x K step (64 / 128 / 256) x operand
order, each unsplit and split toward two programs per SM (BLOCK_M from the rows, warps and stages from
the tile sizes; tiles that overflow shared memory skipped); then the best one's neighbours (warps 4 <->
8, one stage more or less, BLOCK_M halved or doubled). At most 35 configs a (linear, M), plus the
default. Compiling dominates the run: about 100 kernels, shared across shapes and M (the kernel does not
specialise on M); they took a minute to compile for sm_90 on one CPU core, so an estimated 2-3 minutes
in all on an H100, less with fewer --rows or a warm Triton cache. Each config's
output is first checked against an fp32 product of the same FP8 values on a NaN-poisoned output; a
wrong one is reported and left out, one that fails to compile is skipped.

Timing: CUDA events, median of 20 runs after warm-up, each call on the next of enough copies of the
weight to overflow twice the L2 cache (a decode step reads each layer's weights from HBM, so an
L2-resident weight would flatter the small linears; the bf16 peer rotates its copies alike).

One line per (linear, M): the best config, its µs, the small-rows heuristic's µs (``small_rows_config``,
labelled default) and bf16 cuBLAS's; then one line per M: the four linears summed for bf16, the default and the best.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from bench.engine.decode_step import time_cuda
from bench.engine.gemv import layer_shapes
from worker.model.kernels.w8a16_gemm import (
    MIN_K_PER_SPLIT,
    W8A16Config,
    block_m,
    num_stages,
    programs,
    small_rows_config,
    w8a16_matmul,
)
from worker.model.quant import quantize_rows

Weights = list[tuple[torch.Tensor, torch.Tensor]]


def warps(bm: int, bn: int) -> int:
    return 8 if bm * bn >= 128 * 128 else 4


def first_grid(rows: int, n: int, k: int, num_sms: int) -> list[W8A16Config]:
    """Column tile x K step x operand order, each unsplit and split toward two programs per SM."""
    bm, configs = block_m(rows), []
    for swap, bn, bk in itertools.product((False, True), (32, 64, 128), (64, 128, 256)):
        stages = num_stages(bm, bn, bk)
        if not stages or (swap and bn < 64):
            continue  # buffers overflow shared memory; a swapped 32-column tile fills half a wgmma (64 rows)
        tiles = triton.cdiv(rows, bm) * triton.cdiv(n, bn)
        for split in sorted({1, min(triton.cdiv(2 * num_sms, tiles), max(1, k // MIN_K_PER_SPLIT))}):
            configs.append(W8A16Config(bm, bn, bk, split, warps(bm, bn), stages, swap))
    return configs


def neighbours(c: W8A16Config, rows: int) -> list[W8A16Config]:
    """The best first-phase config with other warps, one stage more or less, BLOCK_M halved or doubled."""
    other_warps = 4 if c.num_warps == 8 else 8
    out = [W8A16Config(c.block_m, c.block_n, c.block_k, c.split_k, other_warps, c.num_stages, c.swap_ab)]
    for stages in (c.num_stages - 1, c.num_stages + 1):  # one past the budget may still fit: tried
        if 2 <= stages <= num_stages(c.block_m, c.block_n, c.block_k) + 1:
            out.append(W8A16Config(c.block_m, c.block_n, c.block_k, c.split_k, c.num_warps, stages, c.swap_ab))
    for bm in (c.block_m // 2, c.block_m * 2):
        stages = num_stages(bm, c.block_n, c.block_k)
        if 16 <= bm <= 128 and bm < 2 * rows and stages:
            out.append(W8A16Config(bm, c.block_n, c.block_k, c.split_k, warps(bm, c.block_n), stages, c.swap_ab))
    return out


def label(c: W8A16Config) -> str:
    order = "swap" if c.swap_ab else "noswap"
    return f"bm{c.block_m} bn{c.block_n} bk{c.block_k} split{c.split_k} w{c.num_warps} st{c.num_stages} {order}"


def rotating(fn: Callable[..., torch.Tensor], args: list) -> Callable[[], torch.Tensor]:
    """fn on the next of the argument tuples each call: each call reads a weight L2 has not kept."""
    cycle = itertools.cycle(args)
    return lambda: fn(*next(cycle))


def copies_for(nbytes: int) -> int:
    return max(1, triton.cdiv(2 * torch.cuda.get_device_properties(0).L2_cache_size, nbytes))


class Case:
    """One (linear, M): x, rotated FP8 and bf16 weights, the fp32 reference, and the configs' times."""

    def __init__(self, n: int, k: int, m: int):
        w, s = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
        self.m, self.n, self.k = m, n, k
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        self.fp8: Weights = [(w, s)] + [(w.clone(), s) for _ in range(copies_for(w.nbytes) - 1)]
        w16 = (w.float() * s[:, None]).to(torch.bfloat16)
        self.bf16 = [w16] + [w16.clone() for _ in range(copies_for(w16.nbytes) - 1)]
        self.want = (self.x.float() @ w.float().T) * s[None, :]
        self.times: dict[W8A16Config, float] = {}
        self.wrong: list[str] = []

    def check(self, c: W8A16Config) -> bool:
        out = torch.full((self.m, self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
        w8a16_matmul(self.x, *self.fp8[0], out=out, config=c)
        tol = 2e-2 * self.want.abs().max().item()
        ok = not out.isnan().any().item() and torch.allclose(out.float(), self.want, atol=tol, rtol=2e-2)
        if not ok:
            self.wrong.append(label(c))
        return ok

    def time(self, c: W8A16Config, repeat: int) -> float | None:
        """µs, or None for a config that does not compile or gives a wrong output."""
        if c not in self.times:
            try:
                if not self.check(c):
                    return None
            except Exception as e:  # a config the compiler refuses (out of shared memory, registers)
                print(f"  skipped {label(c)}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                return None
            fn = rotating(lambda x, w, s: w8a16_matmul(x, w, s, config=c), [(self.x, w, s) for w, s in self.fp8])
            self.times[c] = statistics.median(time_cuda(fn, repeat=repeat, warmup=3)) * 1e6
        return self.times[c]

    def bf16_us(self, repeat: int) -> float:
        fn = rotating(F.linear, [(self.x, w) for w in self.bf16])
        return statistics.median(time_cuda(fn, repeat=repeat, warmup=3)) * 1e6


def tune(n: int, k: int, m: int, num_sms: int, repeat: int) -> tuple[W8A16Config, dict[str, float], Case]:
    """The best config of both phases and the µs of best, default and bf16."""
    case = Case(n, k, m)
    default = small_rows_config(m, n, k, num_sms)
    for c in first_grid(m, n, k, num_sms):
        case.time(c, repeat)
    first_best = min(case.times, key=case.times.__getitem__)
    for c in neighbours(first_best, m):
        case.time(c, repeat)
    best = min(case.times, key=case.times.__getitem__)
    default_us = case.time(default, repeat)
    assert default_us is not None, f"the default config {label(default)} failed: {case.wrong}"
    return best, {"best": case.times[best], "default": default_us, "bf16": case.bf16_us(repeat)}, case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-shape", default="llama3-8b")
    parser.add_argument("--rows", default="32,64,138,256,742")
    parser.add_argument("--linears", default="qkv_proj,o_proj,gate_up_proj,down_proj")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rows, wanted = [int(r) for r in args.rows.split(",")], args.linears.split(",")
    shapes = [(name, n, k) for name, n, k in layer_shapes(args.model_shape) if name in wanted]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {num_sms} SMs; µs, median of {args.repeat}")
    totals = {m: dict.fromkeys(("bf16", "default", "best"), 0.0) for m in rows}
    start, timed, wrong = time.perf_counter(), 0, 0
    for name, n, k in shapes:
        for m in rows:
            best, us, case = tune(n, k, m, num_sms, args.repeat)
            timed, wrong = timed + len(case.times), wrong + len(case.wrong)
            for way, t in us.items():
                totals[m][way] += t
            print(
                f"{name:<13}(N{n},K{k}) M={m:<4} best {label(best):<46} {us['best']:7.1f} "
                f"(programs {programs(best, m, n, k)})  default {us['default']:7.1f}  bf16 {us['bf16']:7.1f}  "
                f"best/bf16 {us['best'] / us['bf16']:.2f}" + (f"  WRONG: {case.wrong}" if case.wrong else "")
            )
    for m in rows:
        t = totals[m]
        print(
            f"w8a16_tune {args.model_shape} M={m}: four linears bf16 {t['bf16']:.0f} µs, default "
            f"{t['default']:.0f} µs ({t['default'] / t['bf16']:.2f}x), best {t['best']:.0f} µs "
            f"({t['best'] / t['bf16']:.2f}x of bf16)"
        )
    print(f"{timed} configs timed, {wrong} wrong, in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
