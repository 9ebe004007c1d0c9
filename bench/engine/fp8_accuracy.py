"""What FP8 costs in accuracy: perplexity, KL divergence and greedy agreement against the model dtype.

    python -m bench.engine.fp8_accuracy                      # GPU: the embedded SmolLM2, then llama3-8b's shape
    python -m bench.engine.fp8_accuracy --smoke              # CPU: a tiny random Llama (the test runs this)
    python -m bench.engine.fp8_accuracy --device cpu --shape "" --arms none --bf16   # CPU: bf16 against fp32

Arms, on the same weights: the reference (the model dtype: bf16 on a GPU, fp32 on a CPU), FP8 weights
(``--quantization fp8``), the FP8 KV pool alone (``--kv_cache_dtype fp8_e4m3``), both, and FP8 weights
with the inputs in the model dtype (``--quantization fp8_w8a16``) (``--arms`` picks some; ``none``: only the
reference); with ``--bf16`` on a CPU, the model and its pool in bf16 (what ``--dtype auto`` runs on a CPU
with native bf16) against the fp32 reference; with ``--quantized DIR``, a ``lightq
quantize`` checkpoint of ``--model`` (GPTQ-rounded FP8 weights, W8A16; quantise it with another ``--seed``
than this run's, so the scored text is not its calibration text).

The text: ``--seqs`` sequences of ``--seq-len`` tokens (64 x 320 = 20,480 by default) sampled from the
reference model at temperature 1 from seeded random first tokens: fixed for a model, seed and device,
and every arm scores the same ids. Scoring is packed prefills of 8 sequences through the real pool and
kernels, the logits of every position: the text's perplexity under each arm, the mean KL(reference ||
arm) of the next-token distributions, and the top-1 agreement. Greedy: the first 32 tokens of each
sequence as a prompt, ``--new`` tokens decoded greedily by each arm (decode steps through the pool, all
prompts at once): the share of positions where the arm's token is the reference's (free-running: after
a first difference the two texts part, so this counts every later token against the arm), the
continuations identical throughout, and the teacher-forced agreement (the reference's greedy
continuation fed to the arm: the share of its tokens the arm would have picked itself). A random-weight
shape (``--shape``, llama3-8b by default) is scored the same way on fewer tokens: its distributions are
near uniform, so its figures say the large matrices' FP8 arithmetic is sound, not how a trained model
fares.
"""

from __future__ import annotations

import argparse
import atexit
import math
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from bench.engine.shapes import config_dir
from shared.model_files import ModelSource, resolve
from worker.model.loader import load_model
from worker.model.quant import FP8
from worker.runner.sequence_pool import SequencePool, sample_text

ARMS = ("reference", "fp8 weights", "fp8 kv", "fp8 weights + kv", "fp8 weights only (w8a16)")
BF16_ARM = "bf16 model + pool"  # --bf16, against an fp32 reference (a CPU)
GPTQ_ARM = "gptq checkpoint (w8a16)"  # with --quantized, on --model only; then also with the FP8 KV pool
PROMPT_LEN = 32
SCORE_BATCH = 8


@dataclass
class Tally:
    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    positions: int = 0
    greedy_same: int = 0
    greedy_total: int = 0
    identical: int = 0
    forced_same: int = 0  # the reference's greedy tokens this arm also picks, given the same prefix


def teacher_forced(model, pool: SequencePool, prompts: torch.Tensor, ref_out: torch.Tensor) -> int:
    """How many of the reference's greedy tokens ``ref_out`` [B, new] the arm picks after the same prefix."""
    same, P, new = 0, prompts.shape[1], ref_out.shape[1]
    for start in range(0, prompts.shape[0], SCORE_BATCH):
        seqs = torch.cat((prompts, ref_out[:, :-1]), dim=1)[start : start + SCORE_BATCH]  # [b, P + new - 1]
        logits = pool.prefill(model, seqs, all_logits=True).view(seqs.shape[0], P + new - 1, -1)
        same += int((logits[:, P - 1 :].argmax(-1) == ref_out[start : start + SCORE_BATCH]).sum())
    return same


def greedy(model, pool: SequencePool, prompts: torch.Tensor, new: int) -> torch.Tensor:
    logits = pool.prefill(model, prompts, all_logits=False)
    out = []
    for step in range(new):
        nxt = logits.argmax(-1)
        out.append(nxt)
        if step < new - 1:
            logits = pool.decode(model, nxt, prompts.shape[1] + step)
    return torch.stack(out, dim=1)  # [B, new]


@torch.inference_mode()
def evaluate(source: ModelSource, name: str, args, device: torch.device) -> dict[str, Tally]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arms = {
        "reference": ("none", dtype),
        "fp8 weights": ("fp8", dtype),
        "fp8 kv": ("none", FP8),
        "fp8 weights + kv": ("fp8", FP8),
        "fp8 weights only (w8a16)": ("fp8_w8a16", dtype),
    }
    chosen = set(args.arms.split(","))
    arms = {arm: how for arm, how in arms.items() if arm == "reference" or "all" in chosen or arm in chosen}
    if args.bf16 and dtype == torch.float32:  # what `--dtype auto` picks on a CPU with native bf16
        arms[BF16_ARM] = ("bf16", torch.bfloat16)
    models = {
        q: load_model(source, dtype, device, seed=args.seed, weights_cache=args.weights_cache, quantization=q)[0]
        for q in {q for q, _ in arms.values()} - {"bf16"}
    }
    if BF16_ARM in arms:
        models["bf16"] = load_model(source, torch.bfloat16, device, seed=args.seed, weights_cache=args.weights_cache)[0]
    if getattr(args, "quantized", ""):  # a checkpoint of `lightq quantize` (GPTQ, weights only: W8A16)
        models["gptq"] = load_model(resolve(args.quantized), dtype, device)[0]
        arms[GPTQ_ARM] = ("gptq", dtype)
        arms[GPTQ_ARM + " + kv"] = ("gptq", FP8)
    rows, width = max(args.seqs, SCORE_BATCH), args.seq_len + args.new
    pools = {(q, kv): SequencePool(models[q], kv, rows, width, device) for q, kv in arms.values()}
    vocab = models["none"].config.vocab_size
    text = sample_text(models["none"], pools[arms["reference"]], args.seqs, args.seq_len, vocab, args.seed)
    tallies = {arm: Tally() for arm in arms}
    for start in range(0, args.seqs, SCORE_BATCH):
        chunk = text[start : start + SCORE_BATCH]
        targets = chunk[:, 1:].reshape(-1)
        keep = torch.ones_like(chunk, dtype=torch.bool)
        keep[:, -1] = False  # the last position has no next token in the text
        keep = keep.reshape(-1)
        ref_logp = None
        for arm in arms:
            q, kv = arms[arm]
            logp = torch.log_softmax(pools[(q, kv)].prefill(models[q], chunk, all_logits=True).float(), -1)[keep]
            ref_logp = logp if ref_logp is None else ref_logp
            t = tallies[arm]
            t.nll -= float(logp.gather(1, targets[:, None]).sum())
            t.kl += float((ref_logp.exp() * (ref_logp - logp)).sum())
            t.top1 += int((logp.argmax(-1) == ref_logp.argmax(-1)).sum())
            t.positions += int(targets.numel())
    prompts = text[:, :PROMPT_LEN]
    ref_out = None
    for arm in arms:
        q, kv = arms[arm]
        out = greedy(models[q], pools[(q, kv)], prompts, args.new)
        ref_out = out if ref_out is None else ref_out
        t = tallies[arm]
        t.greedy_same, t.greedy_total = int((out == ref_out).sum()), out.numel()
        t.identical = int((out == ref_out).all(dim=1).sum())
        t.forced_same = teacher_forced(models[q], pools[(q, kv)], prompts, ref_out)
    print_table(name, dtype, args, tallies)
    return tallies


def print_table(name: str, dtype: torch.dtype, args, tallies: dict[str, Tally]) -> None:
    ref = tallies["reference"]
    ref_ppl = math.exp(ref.nll / ref.positions)
    print(
        f"\n{name}: reference {str(dtype).removeprefix('torch.')}, {args.seqs} x {args.seq_len} = "
        f"{args.seqs * args.seq_len:,} tokens scored ({ref.positions:,} positions), "
        f"greedy {args.seqs} prompts x {args.new} tokens"
    )
    print(
        f"{'arm':<30} {'ppl':>9} {'ppl vs ref':>10} {'mean KL':>9} {'top-1':>7} {'greedy':>7} {'identical':>9}"
        f" {'forced':>7}"
    )
    for arm in tallies:
        t = tallies[arm]
        ppl = math.exp(t.nll / t.positions)
        print(
            f"{arm:<30} {ppl:>9.3f} {ppl / ref_ppl - 1:>+10.2%} {t.kl / t.positions:>9.5f} "
            f"{t.top1 / t.positions:>7.2%} {t.greedy_same / t.greedy_total:>7.2%} "
            f"{t.identical:>4}/{args.seqs:<4} {t.forced_same / t.greedy_total:>7.2%}"
        )
    summary = "; ".join(
        f"{arm}: ppl {math.exp(tallies[arm].nll / tallies[arm].positions) / ref_ppl - 1:+.2%}, "
        f"KL {tallies[arm].kl / tallies[arm].positions:.4f}, greedy "
        f"{tallies[arm].greedy_same / tallies[arm].greedy_total:.1%} (forced "
        f"{tallies[arm].forced_same / tallies[arm].greedy_total:.1%})"
        for arm in list(tallies)[1:]
    )
    print(f"fp8_accuracy {name}: {summary}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a lightq --model_dir ('' skips it)")
    parser.add_argument(
        "--shape", default="llama3-8b", help="a bench.engine.shapes shape, random weights ('' skips it)"
    )
    parser.add_argument(
        "--quantized", default="", help="a `lightq quantize` checkpoint of --model: one more arm (GPTQ, W8A16)"
    )
    parser.add_argument("--arms", default="all", help="the FP8 arms to run, comma-separated names (default: all)")
    parser.add_argument("--bf16", action="store_true", help="one more arm: the model and pool in bf16 (fp32 reference)")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=320)
    parser.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--shape-seqs", type=int, default=16, help="--seqs for the random-weight shape")
    parser.add_argument("--shape-seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weights-cache", help="where a GGUF's dequantised weights are kept (default: a temporary folder)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape only, few tokens (CPU, seconds)")
    args = parser.parse_args(argv)
    if args.weights_cache is None:  # one a run, gone with it
        args.weights_cache = tempfile.mkdtemp(prefix="lightq-fp8-")
        atexit.register(shutil.rmtree, args.weights_cache, ignore_errors=True)
    if args.smoke:
        args.model, args.shape, args.seqs, args.seq_len, args.new = "", "tiny", 8, 48, 8
        args.shape_seqs, args.shape_seq_len = 8, 48
    return args


def main(argv: list[str] | None = None) -> dict[str, dict[str, Tally]]:
    args = parse_args(argv)
    device = torch.device(args.device)
    results = {}
    began = time.perf_counter()
    if args.model:
        results[args.model] = evaluate(resolve(args.model), args.model, args, device)
    if args.shape:
        shaped = argparse.Namespace(
            **{**vars(args), "seqs": args.shape_seqs, "seq_len": args.shape_seq_len, "quantized": ""}
        )
        shaped.new = min(args.new, 32)
        source = ModelSource("dummy", config_dir(args.shape))
        results[args.shape] = evaluate(source, f"{args.shape} (random weights)", shaped, device)
    print(f"({time.perf_counter() - began:.0f} s on {device})")
    return results


if __name__ == "__main__":
    main()
