"""``bench.serving.cpu_bench``'s peer: the same workload through transformers' ``generate`` on the same
threads, in static batches of ``--batch-size`` (left-padded, greedy, exactly ``new_tokens`` each) and,
with ``--generate-batch``, its continuous batching. Imported only when the peer runs: transformers'
import costs seconds.
"""

from __future__ import annotations

import os
import time

from tqdm import tqdm

from bench.serving.cpu_bench import Workload


def load_transformers(dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    from shared.model_files import resolve

    folder, name = os.path.split(resolve("default").path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype)).eval()


def static_batches(model, work: Workload, batch_size: int, pad_id: int) -> float:
    """The prompts in order, ``batch_size`` at a time, left-padded, greedy; seconds for all."""
    import torch

    def one_batch(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
        )
        assert out.shape[1] == width + new_tokens, out.shape

    with torch.inference_mode():
        one_batch([p[:16] for p in work.prompts[:batch_size]], 4)  # warm-up
        start = time.perf_counter()
        for i in tqdm(range(0, len(work.prompts), batch_size), desc=f"transformers static-{batch_size}", unit="batch"):
            one_batch(work.prompts[i : i + batch_size], work.new_tokens)
        return time.perf_counter() - start


def continuous_batching(model, work: Workload) -> float:
    """transformers' ``generate_batch`` over every prompt; seconds (its own warm-up not counted)."""
    import torch
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=work.new_tokens, do_sample=False, eos_token_id=-1)
    with torch.inference_mode():
        model.generate_batch([p[:16] for p in work.prompts[:4]], generation_config=config)  # warm-up
        start = time.perf_counter()
        results = model.generate_batch(work.prompts, generation_config=config, progress_bar=True)
        wall = time.perf_counter() - start
    lengths = [len(r.generated_tokens) for r in results.values()]
    if len(lengths) != len(work.prompts) or any(n != work.new_tokens for n in lengths):
        raise RuntimeError(f"generate_batch returned lengths {sorted(set(lengths))} for {len(lengths)} requests")
    return wall


def run_transformers(
    work: Workload, threads: int, batch_size: int, with_generate_batch: bool, repeat: int, dtype: str = "float32"
):
    import torch

    torch.set_num_threads(threads)
    model = load_transformers(dtype)
    static = 0.0
    for _ in range(repeat):
        wall = static_batches(model, work, batch_size, pad_id=model.config.pad_token_id or 0)
        print(
            f"  transformers static-{batch_size}: {work.output_tokens} tokens in {wall:.2f} s = "
            f"{work.output_tokens / wall:.1f} out tok/s",
            flush=True,
        )
        static = max(static, work.output_tokens / wall)
    cb = None
    if with_generate_batch:
        if not hasattr(model, "generate_batch"):
            print("  transformers generate_batch: not in this transformers version", flush=True)
            return static, cb
        model.set_attn_implementation("sdpa")
        cb = 0.0
        for _ in range(repeat):
            wall = continuous_batching(model, work)
            print(
                f"  transformers generate_batch: {work.output_tokens} tokens in {wall:.2f} s = "
                f"{work.output_tokens / wall:.1f} out tok/s",
                flush=True,
            )
            cb = max(cb, work.output_tokens / wall)
    return static, cb
