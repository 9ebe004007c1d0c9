"""Batched sampling on the model's device: greedy, temperature, top-k, top-p.

All rows are handled in one pass; the chosen ids and their log-probabilities
come back to the host in a single copy per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.schemas import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    greedy: torch.Tensor       # [B] bool
    temperature: torch.Tensor  # [B] fp32
    top_p: torch.Tensor        # [B] fp32
    top_k: torch.Tensor        # [B] int64, vocab size when disabled
    all_greedy: bool

    @classmethod
    def build(cls, params: list[SamplingParams], vocab_size: int, device: torch.device) -> "SamplingBatch":
        greedy = [p.is_greedy for p in params]
        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)],
                                     dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params],
                               dtype=torch.int64, device=device),
            all_greedy=all(greedy),
        )


def sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], list[float]]:
    """logits: [B, V] fp32 -> (token ids, log-probabilities under the tempered distribution)."""
    scaled = logits / batch.temperature[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    ids = logits.argmax(dim=-1)
    if not batch.all_greedy:
        ids = torch.where(batch.greedy, ids, _sample_filtered(scaled, batch))
    chosen = logprobs.gather(1, ids[:, None])[:, 0]
    host = torch.stack([ids.to(torch.float64), chosen.to(torch.float64)]).cpu()  # the one copy
    return [int(i) for i in host[0].tolist()], host[1].tolist()


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= batch.top_p[:, None], 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p without a host sync.
    race = probs / torch.empty_like(probs).exponential_(1.0)
    return order.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
