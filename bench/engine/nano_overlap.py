"""Can a decode step's attention run under its matmuls? (issue 16: past the no-overlap floor)

    python3 -m bench.engine.nano_overlap --batches 256,512,768 --layers 8

At large decode batches the matmuls are compute-bound and the attention is
bound by reading K/V, and a step runs one after the other: that sum is the
floor `bench.engine.floor` calls "no overlap". Going under it needs the two at once
on one GPU, as NanoFlow does: two halves of the batch ("nano-batches"), the
attention of one half running while the matmuls of the other do.

This times Llama-3-8B-shaped decode layers (random bf16 weights, one copy per
layer so nothing stays in L2; K/V of ``--context`` tokens per request at
scattered pool slots; this repo's Triton decode attention), in CUDA graphs,
median of 20 replays after warm-up:

- ``one batch``: per layer, the matmuls of all B rows, then their attention
  (what the engine does, less norms, rotary and the K/V write);
- ``halves``: the same work as two halves, one after the other (the cost of splitting);
- ``two streams``: the halves pipelined, matmuls on one stream and attention on
  another, so each half's attention can run under the other half's MLP;
- ``green N``: as two streams, with the attention's stream in a CUDA green
  context of N SMs and the matmuls' in one of the rest (where torch has them).

It prints the per-layer times and each variant against ``one batch``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from bench.engine.decode_step import time_cuda
from worker.model.kernels.decode_attention import decode_attention

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336  # Llama-3-8B


class Layers:
    """``n`` layers' weights and K/V pools, and the two ops a half-batch runs per layer."""

    def __init__(self, n: int, batch: int, context: int):
        dev, bf = "cuda", torch.bfloat16
        qkv_out = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.w = [
            [
                torch.randn(o, i, device=dev, dtype=bf) * i**-0.5
                for o, i in ((qkv_out, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN))
            ]
            for _ in range(n)
        ]
        slots = batch * context
        self.kv = [torch.randn(2, slots, KV_HEADS, HEAD_DIM, device=dev, dtype=bf) for _ in range(n)]
        self.table = torch.randperm(slots, device=dev, dtype=torch.int32).view(batch, context)
        self.seq_lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.context = context

    def qkv(self, layer: int, x: torch.Tensor, out: torch.Tensor) -> None:
        torch.matmul(x, self.w[layer][0].t(), out=out)

    def attend(self, layer: int, qkv: torch.Tensor, rows: torch.Tensor, o: torch.Tensor) -> None:
        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        k, v = self.kv[layer]
        decode_attention(q, k, v, o, rows, self.seq_lens[rows], self.table, self.context)

    def mlp(self, layer: int, o: torch.Tensor, x: torch.Tensor) -> None:
        _, wo, wgu, wd = self.w[layer]
        gu = o.flatten(1) @ wo.t() @ wgu.t()
        torch.matmul(F.silu(gu[:, :FFN]) * gu[:, FFN:], wd.t(), out=x)


class Half:
    """One nano-batch's buffers: they cross streams, so they are allocated once, up front."""

    def __init__(self, rows: torch.Tensor):
        n = rows.numel()
        self.rows = rows
        self.x = torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16)
        self.qkv = torch.empty(n, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        self.o = torch.empty(n, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)


def serial(layers: Layers, halves: list[Half]) -> None:
    for layer in range(len(layers.w)):
        for h in halves:
            layers.qkv(layer, h.x, h.qkv)
            layers.attend(layer, h.qkv, h.rows, h.o)
            layers.mlp(layer, h.o, h.x)


def matmuls(layers: Layers, h: Half) -> None:
    for layer in range(len(layers.w)):
        layers.qkv(layer, h.x, h.qkv)
        layers.mlp(layer, h.o, h.x)


def pipelined(layers: Layers, a: Half, b: Half, att: torch.cuda.Stream) -> None:
    """Matmuls on the current stream, attention on ``att``; half b runs half a layer behind a,
    so a's attention overlaps b's MLP and b's attention overlaps a's."""
    mm = torch.cuda.current_stream()

    def attend_async(layer: int, h: Half) -> torch.cuda.Event:
        att.wait_stream(mm)
        with torch.cuda.stream(att):
            layers.attend(layer, h.qkv, h.rows, h.o)
            return att.record_event()

    done_b = None
    for layer in range(len(layers.w)):
        layers.qkv(layer, a.x, a.qkv)
        done_a = attend_async(layer, a)
        if done_b is not None:
            mm.wait_event(done_b)
            layers.mlp(layer - 1, b.o, b.x)
        layers.qkv(layer, b.x, b.qkv)
        done_b = attend_async(layer, b)
        mm.wait_event(done_a)
        layers.mlp(layer, a.o, a.x)
    mm.wait_event(done_b)
    layers.mlp(len(layers.w) - 1, b.o, b.x)


def check(layers: Layers, a: Half, b: Half, att: torch.cuda.Stream) -> None:
    """The pipelined halves compute what the serial ones do (else the timing means nothing)."""
    start = a.x.clone(), b.x.clone()
    serial(layers, [a, b])
    want = a.x.clone(), b.x.clone()
    a.x.copy_(start[0]), b.x.copy_(start[1])
    pipelined(layers, a, b, att)
    torch.cuda.synchronize()
    for got, ref in zip((a.x, b.x), want):
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err < 1e-2 and ref.abs().max() > 0, f"pipelined halves differ from serial: relative error {err:.2e}"


def graph_time(fn, stream: torch.cuda.Stream | None = None) -> float:
    """Median seconds of one replay of ``fn`` captured as a CUDA graph (on ``stream`` if given)."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs' fills are queued there
    with torch.cuda.stream(stream):
        fn()  # warm-up: Triton compiles, cuBLAS picks its kernels
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return statistics.median(time_cuda(graph.replay, repeat=20))


def green_contexts(att_sms: int) -> list:
    """Two green contexts, the matmuls' (the SMs left) and the attention's (``att_sms``). Keep them
    referenced while their streams run: a context is destroyed with its Python object."""
    from torch.cuda.green_contexts import GreenContext

    total = torch.cuda.get_device_properties(0).multi_processor_count
    return [GreenContext.create(num_sms=n, device_id=0) for n in (total - att_sms, att_sms)]


def run(batch: int, args) -> None:
    layers = Layers(args.layers, batch, args.context)
    rows = torch.arange(batch, device="cuda", dtype=torch.int32)
    whole, a, b = Half(rows), Half(rows[: batch // 2]), Half(rows[batch // 2 :])
    side = torch.cuda.Stream()
    check(layers, a, b, side)
    times = {
        "one batch": graph_time(lambda: serial(layers, [whole])),
        "matmuls alone": graph_time(lambda: matmuls(layers, whole)),
        "attention alone": graph_time(lambda: [layers.attend(i, whole.qkv, rows, whole.o) for i in range(args.layers)]),
        "halves": graph_time(lambda: serial(layers, [a, b])),
        "two streams": graph_time(lambda: pipelined(layers, a, b, side)),
    }
    for sms in args.green:
        try:
            contexts = green_contexts(sms)
            mm, att = (c.Stream() for c in contexts)
            times[f"green {sms}"] = graph_time(lambda: pipelined(layers, a, b, att), stream=mm)  # noqa: B023
        except Exception as e:  # noqa: BLE001  (an API torch or the driver may lack: reported, not fatal)
            print(f"  green {sms}: not available ({type(e).__name__}: {str(e)[:120]})")
    base = times["one batch"]
    cells = "  ".join(f"{name} {t / args.layers * 1e3:.3f} ms ({t / base:.2f}x)" for name, t in times.items())
    print(f"batch {batch:>4}  per layer: {cells}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="256,512,768")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--green", default="16,32,48", help="SM counts to try for the attention's green context")
    args = p.parse_args(argv)
    args.green = [int(s) for s in args.green.split(",") if s]
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.layers} layers, context {args.context}")
    for batch in map(int, args.batches.split(",")):
        run(batch, args)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
