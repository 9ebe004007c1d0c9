"""Decode attention's stage-1 tiles against where the engine really puts K/V (issue 16).

    python3 -m bench.engine.decode_attention_tune --batches 8,64,256,768 --context 512 [--kv fp8]
    python3 -m bench.engine.decode_attention_tune --kv fp8 --default-only --scales slot,head   # scale layouts

TokenAttention gives a decode step's new tokens one slot each from the top of
the free stack, so the B requests of a step get B consecutive slots: a
request's decoded tokens lie B rows apart, one 4 KB pool row (K and V of every
head) each, while its prompt is one contiguous run. This times stage 1 + 2 on
three slot layouts (``contiguous``; ``decode``: half the context a contiguous
prompt, half strided by B as decoding leaves it; ``random``), Llama-3-8B heads
(Hq 32, Hkv 8, D 128, bf16), in CUDA graphs of one call per layer copy (8
copies: nothing stays in L2), median of 10 replays, for every tile in the
grid (each checked against the PyTorch reference first, on a poisoned
output). It prints, per layout and batch, the default tiles' K/V read rate and
the best tiles', then the tiles that minimise the summed time of the
``decode`` layout over all batches. ``--default-only`` times the default tiles
alone (an FP8 pool's: ``FP8_POOL_TILES``), once per FP8 scale layout in
``--scales`` (``head``: head-major in memory, as ``KVCache`` keeps them; ``slot``:
a token's scales together, as it kept them before).
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch

from bench.engine.decode_step import time_cuda
from worker.model.kernels.attention_reference import decode_attention_ref
from worker.model.kernels.decode_attention import decode_attention
from worker.model.kernels.decode_launch import FP8_POOL_TILES, Stage1Tiles
from worker.model.quant import quantize_rows

HQ, HKV, D, COPIES = 32, 8, 128, 8


def table_for(layout: str, batch: int, context: int) -> torch.Tensor:
    """[B, context] pool slots of each request, as the layout lays them out."""
    if layout == "contiguous":
        return torch.arange(batch * context, dtype=torch.int32).view(batch, context)
    if layout == "random":
        return torch.randperm(batch * context, dtype=torch.int32).view(batch, context)
    prompt = context // 2
    head = torch.arange(batch * prompt, dtype=torch.int32).view(batch, prompt)
    steps = torch.arange(context - prompt, dtype=torch.int32)
    tail = batch * prompt + steps[None, :] * batch + torch.arange(batch, dtype=torch.int32)[:, None]
    return torch.cat([head, tail], dim=1)


def fp8_pool(rows: int, scales_layout: str = "head") -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 pool layer as worker.model.kv_cache keeps one: e4m3 [rows, 2 Hkv, D], a scale per token and
    head, [rows, 2 Hkv] head-major in memory (``scales_layout`` 'slot': slot-major)."""
    values, scales = quantize_rows(torch.randn(rows * 2 * HKV, D, device="cuda"))
    scales = scales.view(rows, 2 * HKV)
    return values.view(rows, 2 * HKV, D), (scales.T.contiguous().T if scales_layout == "head" else scales)


class Case:
    def __init__(self, layout: str, batch: int, context: int, kv: str = "bf16", scales_layout: str = "head"):
        self.batch, self.context, self.kv = batch, context, kv
        self.table = table_for(layout, batch, context).cuda()
        rows = batch * context
        if kv == "fp8":
            self.pools = [fp8_pool(rows, scales_layout) for _ in range(COPIES)]
        else:
            self.pools = [
                (torch.randn(rows, 2 * HKV, D, device="cuda", dtype=torch.bfloat16), None) for _ in range(COPIES)
            ]
        self.q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.o = torch.empty_like(self.q)
        self.rows = torch.arange(batch, device="cuda", dtype=torch.int32)
        self.seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)

    def call(self, pool: tuple[torch.Tensor, torch.Tensor | None], tiles: Stage1Tiles) -> None:
        values, scales = pool
        decode_attention(
            self.q,
            values[:, :HKV],
            values[:, HKV:],
            self.o,
            self.rows,
            self.seq_lens,
            self.table,
            self.context,
            tiles=tiles,
            **self.scale_views(scales),
        )

    @staticmethod
    def scale_views(scales: torch.Tensor | None) -> dict:
        return {} if scales is None else {"k_scale": scales[:, :HKV], "v_scale": scales[:, HKV:]}

    def check(self, tiles: Stage1Tiles) -> None:
        self.o.fill_(float("nan"))
        self.call(self.pools[0], tiles)
        values, scales = self.pools[0]
        want = decode_attention_ref(
            self.q, values[:, :HKV], values[:, HKV:], self.rows, self.seq_lens, self.table, **self.scale_views(scales)
        )
        torch.testing.assert_close(self.o.float(), want.float(), atol=2e-2, rtol=2e-2)

    def seconds(self, tiles: Stage1Tiles) -> float:
        """One call's median time, from a graph of one call per pool copy."""
        run = lambda: [self.call(pool, tiles) for pool in self.pools]  # noqa: E731
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the inputs' copies and fills are queued there
        with torch.cuda.stream(stream):
            run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
        return statistics.median(time_cuda(graph.replay, repeat=10)) / COPIES

    def cell(self, seconds: float) -> str:
        rate = self.batch * self.context * 2 * HKV * D * (1 if self.kv == "fp8" else 2) / seconds / 1e12  # K/V read
        return f"{seconds * 1e6:7.1f} us {rate:.2f} TB/s"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,64,256,768")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--layouts", default="contiguous,decode,random")
    p.add_argument("--kv", choices=["bf16", "fp8"], default="bf16", help="the pool's dtype (fp8: e4m3 and scales)")
    p.add_argument("--default-only", action="store_true", help="time the default tiles alone, per --scales layout")
    p.add_argument("--scales", default="head", help="an FP8 pool's scale layouts: head, slot or both (comma)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.default_only:
        return default_only(args)
    if args.kv == "fp8":  # half the bytes a tile: longer tiles, and the dots in fp16 or bf16
        grid = [
            Stage1Tiles(block_n=n, num_warps=w, num_stages=s, head_major=True, fp16_dot=f)
            for n, w, s, f in itertools.product((64, 128, 256), (4, 8), (2, 3, 4), (False, True))
        ]
    else:
        grid = [
            Stage1Tiles(block_n=n, num_warps=w, num_stages=s, head_major=h)
            for n, w, s, h in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (False, True))
        ]
    probe = Case("random", 8, args.context, args.kv)
    for tiles in grid:
        probe.check(tiles)
    print(f"{torch.cuda.get_device_name()}: {len(grid)} tiles checked against the reference; context {args.context}")
    summed = dict.fromkeys(grid, 0.0)
    default = Stage1Tiles()
    for layout in args.layouts.split(","):
        for batch in map(int, args.batches.split(",")):
            case = Case(layout, batch, args.context, args.kv)
            times = {tiles: case.seconds(tiles) for tiles in grid}
            best = min(times, key=times.get)
            if layout == "decode":
                for tiles, t in times.items():
                    summed[tiles] += t
            print(
                f"{layout:<10} B={batch:>4} default {case.cell(times[default])}  best {case.cell(times[best])}  {best}",
                flush=True,
            )
            del case
            torch.cuda.empty_cache()
    if any(summed.values()):
        ranked = sorted(summed, key=summed.get)
        for tiles in ranked[:3]:
            print(f"decode layout, summed over batches: {summed[tiles] * 1e6:.1f} us  {tiles}")
        print(f"decode layout, summed over batches: {summed[default] * 1e6:.1f} us  default {default}")


def default_only(args: argparse.Namespace) -> None:
    """The default tiles on each layout and batch, once per scale layout of an FP8 pool."""
    tiles = FP8_POOL_TILES if args.kv == "fp8" else Stage1Tiles()
    scale_layouts = args.scales.split(",") if args.kv == "fp8" else ["-"]
    for scales_layout in scale_layouts:
        Case("random", 8, args.context, args.kv, scales_layout).check(tiles)
    print(f"{torch.cuda.get_device_name()}: default tiles {tiles} checked on each scale layout; context {args.context}")
    for layout in args.layouts.split(","):
        for batch in map(int, args.batches.split(",")):
            for scales_layout in scale_layouts:
                case = Case(layout, batch, args.context, args.kv, scales_layout)
                cell = case.cell(case.seconds(tiles))
                print(f"{layout:<10} B={batch:>4} scales {scales_layout:<4} {cell}", flush=True)
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
