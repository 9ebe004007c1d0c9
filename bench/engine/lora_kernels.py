"""The decode LoRA delta per token (``bgmv``) against the tokens grouped by slot (``bgmv_grouped``),
by batch size, on the Llama-3-8B projections' shapes, bf16, adapters of one rank drawn uniformly:
where the worker switches from one to the other (``worker.lora.delta.GROUPED_FROM``).

    python3 -m bench.engine.lora_kernels                      # on a CUDA machine; one table
    python3 -m bench.engine.lora_kernels --adapters 100 --rank 16 --batches 8,16,32,64,128,256,512,768

Each case first checks both against the PyTorch reference (``lora_delta_ref``) on the same random
inputs, then times each with triton.testing.do_bench (median, L2 flushed between runs). The grouped
kernel's time leaves out the grouping: that is done once a step for every layer, and printed on
its own line.
"""

from __future__ import annotations

import argparse

import torch

SHAPES = {"qkv 4096->6144": (4096, 6144), "gate/up 4096->14336": (4096, 14336), "down 14336->4096": (14336, 4096)}


def _case(t: int, k: int, n: int, adapters: int, rank: int) -> tuple[float, float, float, float]:
    import triton.testing

    from worker.lora.delta import lora_delta_ref
    from worker.model.kernels.bgmv import bgmv
    from worker.model.kernels.bgmv_grouped import bgmv_grouped, group_tokens

    dev = torch.device("cuda")
    a = (torch.randn(adapters + 1, rank, k, device=dev) / k**0.5).bfloat16()
    b = (torch.randn(adapters + 1, n, rank, device=dev) / rank**0.5).bfloat16()
    a[0], b[0] = 0, 0
    x = torch.randn(t, k, device=dev).bfloat16()
    slots = torch.randint(1, adapters + 1, (t,), device=dev, dtype=torch.int32)
    groups = group_tokens(slots, adapters + 1)
    want = lora_delta_ref(x, a, b, slots)
    errs = []
    for run in (lambda y: bgmv(y, x, a, b, slots), lambda y: bgmv_grouped(y, x, a, b, groups)):
        y = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
        run(y)
        errs.append(((y.float() - want).norm() / want.norm()).item())
    y = torch.zeros(t, n, device=dev, dtype=torch.bfloat16)
    per_token = triton.testing.do_bench(lambda: bgmv(y, x, a, b, slots), warmup=25, rep=200, return_mode="median")
    grouped = triton.testing.do_bench(
        lambda: bgmv_grouped(y, x, a, b, groups), warmup=25, rep=200, return_mode="median"
    )
    return (
        per_token,
        grouped,
        max(errs),
        triton.testing.do_bench(lambda: group_tokens(slots, adapters + 1), return_mode="median"),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", default="4,8,16,32,64,128,256,512,768")
    args = parser.parse_args()
    print(f"{'shape':<22}{'tokens':>7}{'bgmv ms':>10}{'grouped ms':>11}{'grouped/bgmv':>13}{'max rel err':>13}")
    sort_ms = []
    for name, (k, n) in SHAPES.items():
        for t in [int(b) for b in args.batches.split(",")]:
            per_token, grouped, err, sort = _case(t, k, n, args.adapters, args.rank)
            sort_ms.append((t, sort))
            print(f"{name:<22}{t:>7}{per_token:>10.4f}{grouped:>11.4f}{grouped / per_token:>13.2f}{err:>13.2e}")
    sorts = ", ".join(f"{t} tokens {ms * 1000:.0f} us" for t, ms in sort_ms[: len(sort_ms) // 3])
    print(f"the grouping, once a step: {sorts}")


if __name__ == "__main__":
    main()
