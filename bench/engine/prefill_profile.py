"""One prefill step against its compute floor (issue 16, item 4).

    python -m bench.engine.prefill_profile --model-shape llama3-8b [--tokens 8192] [--repeat 5]

A prefill step of the offline workload: ShareGPT-like prompts (``bench.workloads.sharegpt``) packed
until they fill ``--tokens`` (the last one cut to fit), each asking for one token, fed to a
fresh engine step with nothing else running (prefix cache off, fresh random ids each time,
so nothing is cached). The step's forward is timed with CUDA events, median of
``--repeat`` after a warm-up step. Its floor is its FLOPs over the matrix rate measured in
the same run (one large bf16 matmul): the linears (2 x tokens x parameters), causal attention
(4 x head_dim x heads x sum of L(L+1)/2 per layer) and the LM head (the last token of each
prompt). Then each linear of a decoder layer alone at M = tokens (cuBLAS through F.linear),
and a profiler table of one prefill forward's kernels, grouped by name: where the time over
the floor goes. Prints a short table last.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
import torch.nn.functional as F

from bench.engine.offline import sync
from bench.engine.shapes import SHAPES, config_dir
from bench.engine.step_profile import Timed
from bench.workloads.sharegpt import sharegpt_lengths
from shared.config import ModelSettings
from shared.schemas import GenerateRequest, SamplingParams
from shared.worker_settings import WorkerSettings
from worker.engine.request import Req
from worker.main import build_engine


def prompt_lengths(tokens: int, seed: int) -> list[int]:
    """ShareGPT-like prompt lengths whose sum is exactly ``tokens`` (the last one cut)."""
    lengths: list[int] = []
    for length, _ in sharegpt_lengths(4 * tokens // 100 + 16, seed):
        lengths.append(min(length, tokens - sum(lengths)))
        if sum(lengths) == tokens:
            return lengths
    raise ValueError("draw more prompts")


def one_step(engine, lengths: list[int], vocab: int, rng, tag: str) -> None:
    for i, n in enumerate(lengths):
        msg = GenerateRequest(
            id=f"{tag}-{i}",
            prompt_ids=rng.integers(3, vocab, size=n).tolist(),
            created_ms=0,
            params=SamplingParams(max_new_tokens=1, ignore_eos=True),
        )
        engine.add(Req(msg=msg, inbox_id=f"{i}-0"))
    while engine.has_work:
        engine.step()
    engine.flush()


def matmul_tflops(device: str) -> float:
    """The bf16 matrix rate of this GPU, measured: one 8192 x 4096 x 14336 product, median."""
    import triton.testing

    a = torch.randn(8192, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device=device, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return 2 * 8192 * 4096 * 14336 / ms / 1e9


def flops(shape: dict, lengths: list[int]) -> dict[str, float]:
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, vocab = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]
    d = h // heads
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter
    t = sum(lengths)
    causal = sum(n * (n + 1) / 2 for n in lengths)
    return {
        "linears": 2.0 * t * per_layer * layers,
        "attention": 4.0 * d * heads * causal * layers,
        "lm_head": 2.0 * len(lengths) * h * vocab,
    }


def linears(shape: dict, tokens: int, device: str) -> list[tuple[str, float, float]]:
    """(name, ms, TFLOP/s) of each linear of one layer at M = ``tokens`` through F.linear."""
    import triton.testing

    h, inter = shape["hidden_size"], shape["intermediate_size"]
    d = h // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    rows = []
    for name, n, k in (("qkv_proj", qkv, h), ("o_proj", h, h), ("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
        x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        ms = triton.testing.do_bench(lambda x=x, w=w: F.linear(x, w), warmup=25, rep=200, return_mode="median")
        rows.append((name, ms, 2 * tokens * n * k / ms / 1e9))
    return rows


def kernel_table(engine, lengths: list[int], vocab: int, rng) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        one_step(engine, lengths, vocab, rng, "traced")
        sync()
    print(f"\nkernels of one prefill step of {sum(lengths)} tokens ({len(lengths)} prompts), GPU time:")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=80))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens in the step (batch_max_tokens)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-trace", action="store_true")
    parser.add_argument("--quantization", default="none", help="as the worker's (the floor stays bf16's)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args(argv)
    shape = SHAPES[args.model_shape]
    lengths = prompt_lengths(args.tokens, args.seed)
    settings = WorkerSettings(
        model=ModelSettings(model_dir=f"dummy:{config_dir(args.model_shape)}", max_req_total_len=2048),
        device=args.device,
        batch_max_tokens=args.tokens,
        running_max_req_size=max(64, len(lengths)),
        graph_max_batch_size=64,
        overlap="off",
        prefix_cache=False,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = build_engine(settings)
    vocab, rng = shape["vocab_size"], np.random.default_rng(args.seed)
    runner = engine.runner
    forward = Timed(runner.forward)
    runner.forward = forward
    one_step(engine, lengths, vocab, rng, "warm")
    forward.take_each_ms()
    each = []
    for r in range(args.repeat):
        one_step(engine, lengths, vocab, rng, f"r{r}")
        each.append(sum(ms for is_decode, ms in forward.take_each_ms() if is_decode is False))
    del runner.forward
    ms = statistics.median(each)
    counted = flops(shape, lengths)
    on_gpu = args.device.startswith("cuda")
    rate = matmul_tflops(args.device) if on_gpu else float("nan")
    rows = linears(shape, args.tokens, args.device) if on_gpu else []
    if on_gpu and not args.no_trace:
        kernel_table(engine, lengths, vocab, rng)
    floor_ms = sum(counted.values()) / rate / 1e9
    layers = shape["num_hidden_layers"]
    mean = np.mean(lengths)
    print(f"\n{args.model_shape}: a prefill step of {args.tokens} tokens, {len(lengths)} prompts (mean {mean:.0f})")
    print(f"measured bf16 matmul rate: {rate:.0f} TFLOP/s")
    print(f"forward: median {ms:.2f} ms of {args.repeat} ({', '.join(f'{x:.1f}' for x in each)})")
    print(
        "floor: "
        + ", ".join(f"{k} {v / rate / 1e9:.2f} ms" for k, v in counted.items())
        + f" = {floor_ms:.2f} ms; forward / floor {ms / floor_ms:.2f}"
    )
    for name, lin_ms, tflops in rows:
        print(f"  {name:<13} {lin_ms:7.3f} ms x {layers} = {lin_ms * layers:7.2f} ms  {tflops:5.0f} TFLOP/s")
    if rows:
        print(f"  linears alone: {sum(r[1] for r in rows) * layers:.2f} ms of the {ms:.2f} ms forward")


if __name__ == "__main__":
    main()
