"""A deterministic stand-in model for tests of the serving path (``--model_dir counting``).

Its next token is always the previous one plus one (mod the vocabulary), so
a request's whole output follows from its last prompt token whatever the
batch, the worker or the attempt: chaos tests can check every token. It runs
through the real engine, pool and request table; it just has no attention.

For tests of what a request that kills its worker does to the pool, it can be
told to crash (``Crash``): on a forward whose input holds a given token id, raise
(an exception the worker dies of) or end the process at once (``os._exit``: no
``finally``, no hand-back, as a crash of native code). Off unless set.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from worker.model.forward_batch import ForwardBatch

# The stand-in's vocabulary: the tokenizer's first ids (real tokens, so chunks carry text), few
# enough that its [B, V] logits and their sampling cost next to nothing, as a stand-in should:
# with the whole 49,152-token vocabulary, sampling on one CPU core was ~90% of a worker's time
# in a burst of 512 requests, which hid the serving path it stands in for.
COUNTING_VOCAB = 4096
CRASH_EXIT_CODE = 70  # what a worker ended by ``Crash.exit_token`` exits with (EX_SOFTWARE)

log = logging.getLogger("lightq.worker")


class InjectedCrash(RuntimeError):
    """Raised on purpose by the stand-in (``Crash.raise_token``)."""


@dataclass(frozen=True)
class Crash:
    """Fault injection for tests (``--counting_raise_token``, ``--counting_exit_token``; -1: off)."""

    raise_token: int = -1
    exit_token: int = -1

    def check(self, input_ids: torch.Tensor) -> None:
        if self.raise_token < 0 and self.exit_token < 0:
            return
        if input_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # a CUDA graph's capture cannot read ids back; prefills (where prompts are) are not graphed
        if self.raise_token >= 0 and bool((input_ids == self.raise_token).any()):
            raise InjectedCrash(f"the counting stand-in was told to crash on token {self.raise_token}")
        if self.exit_token >= 0 and bool((input_ids == self.exit_token).any()):
            log.error("the counting stand-in was told to exit on token %d: exiting now", self.exit_token)
            logging.shutdown()  # flushes the line above: os._exit skips every clean-up
            os._exit(CRASH_EXIT_CODE)


class CountingModel:
    num_layers = 1
    num_kv_heads = 1
    head_dim = 16

    def __init__(self, vocab_size: int, device: torch.device, step_s: float = 0.0, crash: Crash = Crash()):
        self.vocab_size = vocab_size
        self.device = device
        self.dtype = torch.float32
        # Each forward also waits this long, its cores idle, as a host waits on a device's step: a
        # benchmark of the serving path on a small CPU then sees a worker bound by its "device",
        # not one competing with router, producer and client for the same cores.
        self.step_s = step_s
        self.crash = crash

    def set_backend(self, backend: object) -> None:
        """Nothing reads the KV pool; kept for the loader's interface."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.crash.check(batch.input_ids)
        if self.step_s:
            time.sleep(self.step_s)
        last = batch.input_ids[batch.output_index.long()]  # [B] (or [N]: batch.logit_index)
        logits = torch.full((last.shape[0], self.vocab_size), -1e4, dtype=torch.float32, device=self.device)
        logits[torch.arange(last.shape[0], device=self.device), (last + 1) % self.vocab_size] = 0.0
        return logits  # [B, V]


def expected_tokens(last_prompt_token: int, count: int, vocab_size: int) -> list[int]:
    return [(last_prompt_token + i) % vocab_size for i in range(1, count + 1)]
