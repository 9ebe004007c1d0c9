"""Prompt log-probabilities from the prefill's own logits (OpenAI's echo + logprobs, max_tokens 0).

A request that asks (``SamplingParams.prompt_logprobs``) and has not emitted a token yet gets
the logits of every token of each prefill chunk, not only of its last (``ForwardBatch.logit_index``):
the logits at position p give the logprob of prompt token p + 1, so a chunk over positions
[c, c + n) scores prompt tokens c + 1 .. min(c + n, P - 1) (P: the prompt's length; the token after
the prompt is the first output token, scored by the sampler as usual). No second pass. The
logprobs gather on ``Req.prompt_logprobs`` chunk by chunk (reset at a chunk starting at 0: a
request paused before its first token is prefilled again) and leave with its first token.

Such a request never starts after a cached prefix (``worker.engine.kv_slots``): the cached
positions would have no logits here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from worker.engine.request import Req
from worker.runner.sampler import FLOOR_LOGPROB

SCORE_BLOCK = 256  # rows of logits turned into logprobs at a time


def wants_prompt_logprobs(req: Req) -> bool:
    return req.msg.params.prompt_logprobs is not None and not req.output_ids


def logit_index(reqs: Sequence[Req], num_new: Sequence[int]) -> tuple[np.ndarray | None, np.ndarray]:
    """(packed tokens to return logits for, None when only each last one is needed; the position of
    each request's last token among the returned rows)."""
    starts = np.concatenate([[0], np.cumsum(num_new)[:-1]]).astype(np.int64)
    if not any(wants_prompt_logprobs(r) for r in reqs):
        return None, np.arange(len(reqs))
    index: list[int] = []
    last_rows = np.empty(len(reqs), dtype=np.int64)
    for i, (req, start, n) in enumerate(zip(reqs, starts, num_new)):
        index.extend(range(start, start + n) if wants_prompt_logprobs(req) else [start + n - 1])
        last_rows[i] = len(index) - 1
    return np.asarray(index, dtype=np.int64), last_rows


@torch.inference_mode()
def gather(reqs: Sequence[Req], num_new: Sequence[int], cached: Sequence[int], logits: torch.Tensor) -> None:
    """Record each asking request's chunk of prompt logprobs from ``logits`` (rows as ``logit_index``)."""
    row = 0
    for req, n, start in zip(reqs, num_new, cached):
        if not wants_prompt_logprobs(req):
            row += 1
            continue
        if start == 0 or req.prompt_logprobs is None:
            req.prompt_logprobs = []
        prompt = req.msg.prompt_ids
        scored = max(0, min(n, len(prompt) - 1 - int(start)))  # rows whose next token is a prompt token
        if scored:
            req.prompt_logprobs += _score(logits[row : row + scored], prompt[start + 1 : start + 1 + scored], req)
        row += n


def _score(logits: torch.Tensor, targets: list[int], req: Req) -> list[tuple[float, list[tuple[int, float]]]]:
    """(logprob of each target, its ``prompt_logprobs`` most likely alternatives), in blocks of rows:
    the forward already holds [chunk, V] logits (bounded by ``batch_max_tokens``); the log-softmax
    temporaries stay at [SCORE_BLOCK, V]."""
    out: list[tuple[float, list[tuple[int, float]]]] = []
    for start in range(0, len(targets), SCORE_BLOCK):
        out += _score_block(logits[start : start + SCORE_BLOCK], targets[start : start + SCORE_BLOCK], req)
    return out


def _score_block(logits: torch.Tensor, targets: list[int], req: Req) -> list[tuple[float, list[tuple[int, float]]]]:
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    ids = torch.tensor(targets, device=logits.device)[:, None]
    # An id of the tokenizer past the logits' columns (a stand-in, or an output layer narrower than
    # the tokenizer) is one the model can never produce: the floor, not an index past V.
    outside = ids >= logp.shape[-1]
    chosen = logp.gather(1, ids.clamp(max=logp.shape[-1] - 1)).masked_fill(outside, FLOOR_LOGPROB)
    parts = [chosen.double().clamp_min(FLOOR_LOGPROB)]
    k = req.msg.params.prompt_logprobs or 0
    if k:
        top = logp.topk(k, dim=-1)
        parts += [top.indices.double(), top.values.double().clamp_min(FLOOR_LOGPROB)]
    host = torch.cat(parts, dim=1).cpu().tolist()
    return [(r[0], [(int(r[1 + i]), r[1 + k + i]) for i in range(k)]) for r in host]
