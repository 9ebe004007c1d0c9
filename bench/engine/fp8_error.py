"""Where FP8's error on a GPU comes from (issue 31): cuBLASLt's row-wise scaled matmul against an fp32
product of the very same FP8 values and scales; the Triton activation quantiser against torch's; and
the tiny test model's prefill logits, CUDA bf16 against the CPU's fp32, with and without FP8 (is a
difference FP8's arithmetic, or the bf16 model's own?).

    python3 -m bench.engine.fp8_error   # on a CUDA device
"""

from __future__ import annotations

import tempfile

import torch

from tests.worker.model_harness import tiny_gpu_llama
from worker.model.kernels.fp8_quant import quantize_rows as quantize_kernel
from worker.model.quant import quantize_rows


def linear_error(rows: int, k: int = 512, n: int = 384) -> None:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w, ws = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
    xq, xs = quantize_kernel(x)
    exact = (xq.float() @ w.float().T) * xs[:, None] * ws[None, :]
    bound = (exact.abs() * 2.0**-8).max().item()  # bf16's rounding of the largest output
    for fast in (False, True):
        y = torch._scaled_mm(
            xq, w.T, scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16, use_fast_accum=fast
        )
        err = (y.float() - exact).abs()
        print(
            f"scaled_mm rows {rows} fast_accum {fast}: max err {err.max():.4f} (bf16 rounding {bound:.4f}), "
            f"max |y| {exact.abs().max():.2f}, worst where |y| {exact.flatten()[err.argmax()].abs():.3f}"
        )
    tq, ts = quantize_rows(x)
    print(
        f"quantiser rows {rows}: scales differing {(ts != xs).sum().item()} of {rows} (max rel "
        f"{((ts - xs).abs() / xs).max():.2e}), FP8 values differing {(tq.float() != xq.float()).sum().item()}"
    )


def tiny_model() -> str:
    folder = tempfile.mkdtemp(prefix="tiny-fp8-")
    tiny_gpu_llama().save_pretrained(folder)
    return folder


def main() -> None:
    # here, not at the top: the test module skips itself without CUDA, which would fail any import of this one
    from tests.worker.test_fp8_gpu import prefill_logits

    torch.manual_seed(0)
    for rows in (64, 300):
        linear_error(rows)
    folder, prompts = tiny_model(), [[1, 5, 9, 200, 13], list(range(100, 160)), [7]]
    ref = {q: prefill_logits(folder, "cpu", prompts, quantization=q) for q in ("none", "fp8")}
    for q in ("none", "fp8"):
        cuda = prefill_logits(folder, "cuda", prompts, quantization=q, dtype=torch.bfloat16)
        rel = ((cuda - ref[q]).abs().max() / ref[q].abs().max()).item()
        agree = (cuda.argmax(-1) == ref[q].argmax(-1)).float().mean().item()
        print(f"tiny model, quantization {q}: CUDA bf16 vs CPU fp32 max rel {rel:.4f}, argmax agree {agree:.1%}")
    rel = ((ref["fp8"] - ref["none"]).abs().max() / ref["none"].abs().max()).item()
    print(f"tiny model on the CPU: fp8 vs none max rel {rel:.4f}")


if __name__ == "__main__":
    main()
