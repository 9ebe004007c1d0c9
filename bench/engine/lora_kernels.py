"""The decode LoRA delta per token (``bgmv``) against the tokens grouped by slot (``bgmv_grouped``),
by batch size, on the Llama-3-8B projections' shapes, bf16, adapters of one rank drawn uniformly:
where the worker switches from one to the other (``worker.lora.delta.GROUPED_FROM``).

    python3 -m bench.engine.lora_kernels                      # on a CUDA machine; one table
    python3 -m bench.engine.lora_kernels --adapters 100 --rank 16 --batches 8,16,32,64,128,256,512,768
    python3 -m bench.engine.lora_kernels --tune --adapters 64 --batches 77   # tiles, on the model's layers
    python3 -m bench.engine.lora_kernels --prefill 3000 --adapters 64          # a prefill step's kernels
    python3 -m bench.engine.lora_kernels --graph --adapters 64 --batches 77    # a decode step's, in a graph

``--tune``: each kernel's expand tile (``block_n``) and shrink K per program (``split_k``) swept on the
worker's own adapted layers of Llama-3-8B (qkv and gate_up fused, their B block diagonal), each
config checked against the reference first; per config, the four layers' sum times 32 layers: a
decode step's LoRA time at that batch (the 1,000-adapter run's slot-bound step is ~77 tokens over
64 adapters).

``--prefill T``: a prefill step of T tokens in ShareGPT-like prompts (``bench.engine.prefill_profile``),
each prompt with its own adapter, on the same four layers: ``sgmv`` (a program per segment and row
block, the grid sized by the longest prompt) against the grouped kernel at several tokens a block
(``block_m``) and shrink splits, and the base layer's cuBLAS matmul at M = T for scale; each checked
against the reference first.

``--graph``: the grouped kernel's settings (output tile, shrink split, warps) on a decode step's
LoRA work as the step runs it: the four adapted layers of all 32 layers, each layer its own stacks
(5.4 GB at 64 adapters of rank 16: nothing stays in L2 between layers), every call captured in one
CUDA graph, timed by replays (median of 20, CUDA events); each setting checked on one layer first.
(``do_bench`` per layer, eager, ranked settings unlike the step: bench/RESULTS.md.)

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


# Llama-3-8B's adapted layers as the worker fuses them: (K, each shard's output rows)
LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}  # fmt: skip


def _layer(k: int, sizes: tuple[int, ...], adapters: int, rank: int):
    """A and B stacks as ``AdapterSet`` builds them (B block diagonal), slot 0 zeros, and its Shards."""
    from worker.model.kernels.lora_shards import Shards

    dev, n, r = torch.device("cuda"), sum(sizes), rank * len(sizes)
    a = (torch.randn(adapters + 1, r, k, device=dev) / k**0.5).bfloat16()
    b = torch.zeros(adapters + 1, n, r, device=dev, dtype=torch.bfloat16)
    for i, size in enumerate(sizes):
        row = sum(sizes[:i])
        block = torch.randn(adapters + 1, size, rank, device=dev) / rank**0.5
        b[:, row : row + size, i * rank : (i + 1) * rank] = block
    a[0], b[0] = 0, 0
    ends = tuple(sum(sizes[: i + 1]) for i in range(len(sizes)))
    return a, b, Shards(ends, rank)


def tune(t: int, adapters: int, rank: int) -> None:
    import itertools

    import triton.testing

    from worker.lora.delta import lora_delta_ref
    from worker.model.kernels.bgmv import bgmv
    from worker.model.kernels.bgmv_grouped import bgmv_grouped, group_tokens

    slots = torch.randint(1, adapters + 1, (t,), device="cuda", dtype=torch.int32)
    groups = group_tokens(slots, adapters + 1)
    layers = {name: (_layer(k, sizes, adapters, rank), torch.randn(t, k, device="cuda").bfloat16())
              for name, (k, sizes) in LAYERS.items()}  # fmt: skip
    kernels = {"bgmv": lambda y, x, a, b, sh, bn, sk: bgmv(y, x, a, b, slots, shards=sh, block_n=bn, split_k=sk),
               "grouped": lambda y, x, a, b, sh, bn, sk: bgmv_grouped(y, x, a, b, groups, shards=sh, block_n=bn,
                                                                      split_k=sk)}  # fmt: skip
    distinct = len(set(slots.tolist()))
    print(f"{t} tokens over {distinct} of {adapters} adapters, rank {rank}: ms a layer, and x 32 layers")
    print(f"{'kernel':<9}{'block_n':>8}{'split_k':>8}" + "".join(f"{name:>9}" for name in LAYERS) + f"{'step ms':>9}")
    for kernel, (bn, sk) in itertools.product(kernels, itertools.product((64, 128, 256), (256, 512, 1024))):
        row = []
        for (a, b, shards), x in layers.values():
            y = torch.zeros(t, b.shape[1], device="cuda", dtype=torch.bfloat16)
            kernels[kernel](y, x, a, b, shards, bn, sk)
            want = lora_delta_ref(x, a, b, slots)
            assert ((y.float() - want).norm() / want.norm()).item() < 2e-2, (kernel, bn, sk)
            row.append(triton.testing.do_bench(lambda: kernels[kernel](y, x, a, b, shards, bn, sk),  # noqa: B023
                                               warmup=25, rep=100, return_mode="median"))  # fmt: skip
        cells = "".join(f"{ms:>9.4f}" for ms in row)
        print(f"{kernel:<9}{bn:>8}{sk:>8}{cells}{sum(row) * 32:>9.3f}")


def prefill(t: int, adapters: int, rank: int, seed: int = 0) -> None:
    import itertools

    import torch.nn.functional as F
    import triton.testing

    from bench.engine.prefill_profile import prompt_lengths
    from worker.lora.delta import lora_delta_ref
    from worker.model.kernels.bgmv_grouped import bgmv_grouped, group_tokens
    from worker.model.kernels.sgmv import sgmv

    lengths = prompt_lengths(t, seed)
    gen = torch.Generator().manual_seed(seed)
    seg_slots = torch.randint(1, adapters + 1, (len(lengths),), generator=gen).int().cuda()
    q_lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    q_starts = (torch.cumsum(q_lens, 0) - q_lens).int()
    slots = torch.repeat_interleave(seg_slots, q_lens)
    layers = {name: (_layer(k, sizes, adapters, rank), torch.randn(t, k, device="cuda").bfloat16())
              for name, (k, sizes) in LAYERS.items()}  # fmt: skip
    arms = {"sgmv": lambda y, x, a, b, sh: sgmv(y, x, a, b, q_starts, q_lens, seg_slots, max(lengths), shards=sh)}
    for bm, sk in itertools.product((16, 32, 64), (512, 1024)):
        groups = group_tokens(slots, adapters + 1, bm)
        arms[f"grouped {bm}/{sk}"] = (  # noqa: B023 (bound now: the default arguments)
            lambda y, x, a, b, sh, g=groups, sk=sk: bgmv_grouped(y, x, a, b, g, shards=sh, split_k=sk)
        )
    print(f"prefill of {t} tokens in {len(lengths)} prompts (longest {max(lengths)}), an adapter each of {adapters},"
          f" rank {rank}: ms a layer, and x 32 layers")  # fmt: skip
    print(f"{'arm':<18}" + "".join(f"{name:>9}" for name in LAYERS) + f"{'step ms':>9}")
    base = []
    for (_, b, _), x in layers.values():  # the base layer's matmul at M = t, for scale
        w = torch.randn(b.shape[1], x.shape[1], device="cuda").bfloat16()
        base.append(triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50, return_mode="median"))  # noqa: B023
    print(f"{'base (cuBLAS)':<18}" + "".join(f"{ms:>9.4f}" for ms in base) + f"{sum(base) * 32:>9.3f}")
    for arm, run in arms.items():
        row = []
        for (a, b, shards), x in layers.values():
            y = torch.full((t, b.shape[1]), float("nan"), device="cuda", dtype=torch.bfloat16)
            y[:] = 0
            run(y, x, a, b, shards)
            want = lora_delta_ref(x, a, b, slots)
            assert ((y.float() - want).norm() / want.norm()).item() < 2e-2, arm
            row.append(triton.testing.do_bench(lambda: run(y, x, a, b, shards), warmup=10, rep=50,  # noqa: B023
                                               return_mode="median"))  # fmt: skip
        print(f"{arm:<18}" + "".join(f"{ms:>9.4f}" for ms in row) + f"{sum(row) * 32:>9.3f}")
    grouping = triton.testing.do_bench(lambda: group_tokens(slots, adapters + 1, 32), return_mode="median")
    print(f"the grouping, once a step: {grouping * 1000:.0f} us")


GRAPH_SETTINGS = [  # (block_n, split_k, (shrink warps, expand warps)); the first is the default
    (64, 512, (4, 4)), (64, 512, (4, 1)), (64, 512, (4, 2)), (64, 512, (2, 2)), (64, 512, (1, 1)),
    (128, 512, (4, 2)), (128, 512, (4, 4)), (256, 512, (4, 4)), (256, 512, (4, 8)), (64, 1024, (4, 1)),
    (128, 1024, (2, 2)), (64, 256, (2, 1)),
]  # fmt: skip


def graph(t: int, adapters: int, rank: int, layers: int = 32) -> None:
    from worker.lora.delta import lora_delta_ref
    from worker.model.kernels.bgmv_grouped import bgmv_grouped, group_tokens

    slots = (torch.arange(t, device="cuda", dtype=torch.int32) % adapters) + 1  # as step_profile --lora-adapters
    groups = group_tokens(slots, adapters + 1)
    stacks = [[(_layer(k, sizes, adapters, rank), torch.randn(t, k, device="cuda").bfloat16())
               for k, sizes in LAYERS.values()] for _ in range(layers)]  # fmt: skip
    ys = [[torch.zeros(t, b.shape[1], device="cuda", dtype=torch.bfloat16) for (_, b, _), _ in row] for row in stacks]
    gb = sum(a.numel() * 2 + b.numel() * 2 // len(sh.ends) for row in stacks for (a, b, sh), _ in row) * 64 / 65 / 1e9
    print(f"{t} tokens over {adapters} adapters, rank {rank}, {layers} layers: adapters' A and B {gb:.2f} GB"
          f" ({gb / 3.35:.2f} ms at 3.35 TB/s)")  # fmt: skip
    print(f"{'block_n':>8}{'split_k':>8}{'warps':>8}{'ms a step':>11}")
    for bn, sk, warps in GRAPH_SETTINGS:
        (a, b, shards), x = stacks[0][2]
        y = torch.zeros_like(ys[0][2])
        bgmv_grouped(y, x, a, b, groups, shards=shards, block_n=bn, split_k=sk, warps=warps)
        want = lora_delta_ref(x, a, b, slots)
        assert ((y.float() - want).norm() / want.norm()).item() < 2e-2, (bn, sk, warps)
        run = lambda: [bgmv_grouped(y, x, a, b, groups, shards=sh, block_n=bn, split_k=sk, warps=warps)  # noqa: E731,B023
                       for row, yrow in zip(stacks, ys) for ((a, b, sh), x), y in zip(row, yrow)]  # fmt: skip
        run()  # compiled before capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
        times = []
        for _ in range(23):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        print(f"{bn:>8}{sk:>8}{f'{warps[0]}x{warps[1]}':>8}{sorted(times[3:])[10]:>11.3f}")
        del g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", default="4,8,16,32,64,128,256,512,768")
    parser.add_argument("--tune", action="store_true", help="sweep the tiles on the model's layers (above)")
    parser.add_argument("--prefill", type=int, default=0, help="a prefill step of this many tokens (above)")
    parser.add_argument("--graph", action="store_true", help="the decode LoRA settings in a CUDA graph (above)")
    args = parser.parse_args()
    if args.graph:
        for t in [int(b) for b in args.batches.split(",")]:
            graph(t, args.adapters, args.rank)
        return
    if args.prefill:
        prefill(args.prefill, args.adapters, args.rank)
        return
    if args.tune:
        for t in [int(b) for b in args.batches.split(",")]:
            tune(t, args.adapters, args.rank)
        return
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
