"""A deterministic stand-in model for tests of the serving path (``--model_dir counting``).

Its next token is always the previous one plus one (mod the vocabulary), so
a request's whole output follows from its last prompt token whatever the
batch, the worker or the attempt: chaos tests can check every token. It runs
through the real engine, pool and request table; it just has no attention.
"""

from __future__ import annotations

import time

import torch

from worker.model.forward_batch import ForwardBatch

# The stand-in's vocabulary: the tokenizer's first ids (real tokens, so chunks carry text), few
# enough that its [B, V] logits and their sampling cost next to nothing, as a stand-in should:
# with the whole 49,152-token vocabulary, sampling on one CPU core was ~90% of a worker's time
# in a burst of 512 requests, which hid the serving path it stands in for.
COUNTING_VOCAB = 4096


class CountingModel:
    num_layers = 1
    num_kv_heads = 1
    head_dim = 16

    def __init__(self, vocab_size: int, device: torch.device, step_s: float = 0.0):
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = torch.float32
        # Each forward also waits this long, its cores idle, as a host waits on a device's step: a
        # benchmark of the serving path on a small CPU then sees a worker bound by its "device",
        # not one competing with router, producer and client for the same cores.
        self.step_s = step_s

    def set_backend(self, backend) -> None:
        """Nothing reads the KV pool; kept for the loader's interface."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.step_s:
            time.sleep(self.step_s)
        last = batch.input_ids[batch.output_index.long()]  # [B] (or [N]: batch.logit_index)
        logits = torch.full((last.shape[0], self.vocab_size), -1e4, dtype=torch.float32, device=self.device)
        logits[torch.arange(last.shape[0], device=self.device), (last + 1) % self.vocab_size] = 0.0
        return logits  # [B, V]


def expected_tokens(last_prompt_token: int, count: int, vocab_size: int) -> list[int]:
    return [(last_prompt_token + i) % vocab_size for i in range(1, count + 1)]
