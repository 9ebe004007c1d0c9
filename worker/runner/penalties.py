"""Penalties and min_new_tokens on the device, for the whole batch in one pass.

``TokenCounts`` keeps one int32 row per request-table row (plus the hold
row) counting how often each vocabulary token was generated; bit 30 of an
entry marks "this token is in the prompt". Which tokens count:

- presence / frequency (OpenAI, vLLM, LightLLM): generated tokens only,
  ``logit -= count * frequency + (count > 0) * presence``;
- repetition (HF, vLLM, CTRL paper): prompt *and* generated tokens, a seen
  token's positive logit divided by the penalty, a negative one multiplied
  (LightLLM counts only generated tokens unless ``input_penalty``; lightq
  follows HF/vLLM so a repetition penalty also discourages copying the prompt);
- min_new_tokens: EOS logits are -inf while fewer tokens are out.

Order as vLLM and LightLLM: repetition, then frequency/presence. A row whose
parameters are neutral (0, 0, 1, 0) is left exactly as it was.

Ids the logits have no column for are not counted: the producer accepts any id of
the tokenizer's vocabulary, which may be larger than the model's (the counting
stand-in's 4,096 columns against its tokenizer's 49,152). Such an id is one the
model can never produce, so there is no logit to penalise and nothing to block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from shared.schemas import SamplingParams

PROMPT_FLAG = 1 << 30  # set on prompt tokens; output counts stay far below it
COUNT_MASK = PROMPT_FLAG - 1


@dataclass(frozen=True)
class PenaltyBatch:
    """One step's penalty parameters, one entry per batch row, on the device."""

    rows: torch.Tensor  # [B] int64 request-table rows
    presence: torch.Tensor  # [B] fp32
    frequency: torch.Tensor  # [B] fp32
    repetition: torch.Tensor  # [B] fp32
    eos_blocked: torch.Tensor  # [B] bool: fewer than min_new_tokens are out
    any_counts: bool  # some row has presence/frequency/repetition
    any_eos_blocked: bool

    @classmethod
    def build(
        cls, params: Sequence[SamplingParams], rows: torch.Tensor, output_lens: Sequence[int], device: torch.device
    ) -> PenaltyBatch | None:
        """None when no row needs anything (the common case costs nothing).

        ``output_lens[i]``: tokens row i already generated (resumed ones included),
        i.e. the index of the token about to be sampled; ``rows``: [B] table rows.
        """
        any_counts = any(p.has_penalties for p in params)
        blocked = [n < p.min_new_tokens for p, n in zip(params, output_lens)]
        if not any_counts and not any(blocked):
            return None
        floats = torch.tensor(
            [
                [p.presence_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.repetition_penalty for p in params],
                [float(b) for b in blocked],
            ],
            dtype=torch.float32,
        ).to(device, non_blocking=True)  # one copy for all floats
        return cls(
            rows=rows.to(device, torch.int64),
            presence=floats[0],
            frequency=floats[1],
            repetition=floats[2],
            eos_blocked=floats[3] > 0,
            any_counts=any_counts,
            any_eos_blocked=any(blocked),
        )


class TokenCounts:
    """Per-row token counts ``[max_rows + 1, vocab]`` int32 on the device.

    Invariant: for a running request in row r, ``counts[r, t] & COUNT_MASK``
    is how many times t was generated (resumed tokens included) and bit 30
    says whether t is in the prompt. ``start`` establishes it, ``add`` keeps it.
    """

    def __init__(self, max_rows: int, vocab_size: int, eos_ids: Iterable[int], device: torch.device | str):
        self.vocab_size = vocab_size
        self.counts = torch.zeros(max_rows + 1, vocab_size, dtype=torch.int32, device=device)
        eos = sorted(i for i in set(eos_ids) if 0 <= i < vocab_size)
        self.eos = torch.tensor(eos, dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self.counts.device

    def reset(self, rows: Sequence[int] | torch.Tensor) -> None:
        self.counts[torch.as_tensor(rows, dtype=torch.int64, device=self.device)] = 0

    def start(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        """A request takes ``row``: forget the previous holder, mark its prompt, count resumed output
        (only ids below ``vocab_size``: see the module's docstring)."""
        self.counts[row].zero_()
        prompt = self._in_vocab(prompt_ids)
        if prompt.numel():
            self.counts[row, prompt] = PROMPT_FLAG
        output = self._in_vocab(output_ids)
        if output.numel():
            self.add(torch.full_like(output, row), output)

    def _in_vocab(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` on the device, less those outside [0, vocab_size) (filtered on the host: a prompt is there)."""
        host = torch.as_tensor(list(ids), dtype=torch.int64)
        return host[(host >= 0) & (host < self.vocab_size)].to(self.device)

    def add(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """counts[rows[i], token_ids[i]] += 1 for all i, in one indexed add (repeats accumulate).
        ``token_ids`` are sampled from the logits (or filtered by ``start``): below ``vocab_size``."""
        ones = torch.ones(rows.shape[0], dtype=torch.int32, device=self.device)
        self.counts.index_put_(
            (rows.to(self.device, torch.int64), token_ids.to(self.device, torch.int64)), ones, accumulate=True
        )

    def output_counts(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, V] int32: generated-token counts of the rows (prompt flag removed)."""
        return self.counts[rows] & COUNT_MASK

    def apply(self, logits: torch.Tensor, batch: PenaltyBatch) -> torch.Tensor:
        """Penalised logits [B, V] fp32 (a new tensor; ``logits`` is not modified)."""
        if batch.any_counts:
            counts = self.counts[batch.rows]  # [B, V]: one gather for the batch
            seen = counts != 0  # in the prompt or generated
            rep = batch.repetition[:, None]
            penalised = torch.where(logits > 0, logits / rep, logits * rep)
            logits = torch.where(seen, penalised, logits)
            out = (counts & COUNT_MASK).to(logits.dtype)
            logits = logits - out * batch.frequency[:, None] - (out > 0) * batch.presence[:, None]
        if batch.any_eos_blocked and self.eos.numel():
            logits = logits.clone() if not batch.any_counts else logits
            eos_cols = logits[:, self.eos]
            logits[:, self.eos] = eos_cols.masked_fill(batch.eos_blocked[:, None], float("-inf"))
        return logits
