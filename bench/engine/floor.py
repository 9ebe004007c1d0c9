"""The roofline bound of the offline workload: how fast any engine could run it on one GPU.

    python -m bench.engine.floor --weights-gb 15.01 --bandwidth-tbs 4.22 --tflops 790

Every request is admitted at step 0 (the pool holds them all), so decode step s
runs every request with more than s output tokens, each at context prompt + s.
A step cannot be faster than its bytes (weights + every cached K/V) over the
bandwidth, nor than its FLOPs over the matrix rate: ``max`` of the two is the
bound with perfect overlap, their sum a bound without it. The prefill adds its
FLOPs (prompt tokens x FLOPs per token). Every output token is counted as a decode
step, the first too (an engine samples it at the end of the prefill): one step
more than needed, some 20 ms on the default workload, so the bound is that much
loose. Defaults: Llama-3-8B in bf16 and the
H200's measured copy bandwidth and bf16 matrix rate (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.workloads.sharegpt import sharegpt_lengths


def bounds(
    lengths: list[tuple[int, int]],
    weight_bytes: float,
    kv_bytes_per_token: float,
    flops_per_token: float,
    bandwidth: float,
    flops: float,
) -> dict[str, float]:
    prompt = np.array([i for i, _ in lengths])
    output = np.array([o for _, o in lengths])
    steps = np.arange(output.max())
    batch = np.array([(output > s).sum() for s in steps])
    context = np.array([(prompt[output > s] + s).sum() for s in steps])
    memory = (weight_bytes + context * kv_bytes_per_token) / bandwidth
    compute = batch * flops_per_token / flops
    prefill = prompt.sum() * flops_per_token / flops
    return {
        "steps": len(steps),
        "decode_overlap_s": float(np.maximum(memory, compute).sum()),
        "decode_sum_s": float((memory + compute).sum()),
        "prefill_s": float(prefill),
        "output_tokens": int(output.sum()),
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weights-gb", type=float, default=15.01, help="bytes read per step (Llama-3-8B bf16)")
    p.add_argument("--kv-kb-per-token", type=float, default=128.0, help="K/V bytes per token, all layers")
    p.add_argument("--gflop-per-token", type=float, default=15.0, help="2 x parameters")
    p.add_argument("--bandwidth-tbs", type=float, default=4.22, help="measured copy bandwidth, read + write")
    p.add_argument("--tflops", type=float, default=790.0, help="measured bf16 matrix rate")
    args = p.parse_args(argv)
    b = bounds(
        sharegpt_lengths(args.num_requests, args.seed),
        args.weights_gb * 1e9,
        args.kv_kb_per_token * 1024,
        args.gflop_per_token * 1e9,
        args.bandwidth_tbs * 1e12,
        args.tflops * 1e12,
    )
    for name, decode in (("perfect overlap", b["decode_overlap_s"]), ("no overlap", b["decode_sum_s"])):
        total = decode + b["prefill_s"]
        print(
            f"floor ({name}): {b['steps']} decode steps {decode:.2f} s + prefill {b['prefill_s']:.2f} s = "
            f"{total:.2f} s, {b['output_tokens'] / total:,.0f} output tok/s"
        )
    return b


if __name__ == "__main__":
    main()
