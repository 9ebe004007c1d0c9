"""Batched sampling on the model's device: penalties, greedy, temperature,
top-k, top-p, min-p, and per-request seeds.

All rows are handled in one pass; the chosen ids, their log-probabilities
and, for requests that ask (``top_logprobs``), the most likely alternatives
come back to the host in a single copy per step.

Sampling is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per
token draws from ``p`` without a host sync. A seeded request's noise is a
counter-based hash of (seed, output index, token id), so it depends on
nothing else: the same seed and parameters give the same tokens whatever
else is in the batch, on any device, and a request resumed on another
worker continues the same random stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from shared.schemas import SamplingParams
from worker.runner.penalties import PenaltyBatch, TokenCounts

if TYPE_CHECKING:
    from worker.runner.grammar import GrammarMask

M32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9
MIN_NOISE = 1e-20  # torch's exponential_ can return 0, which would turn p = 0 into 0/0

FLOOR_LOGPROB = -9999.0  # alternatives masked to -inf (JSON has no -inf): OpenAI's "too small to show"
TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first


class Sampled(NamedTuple):
    """One step's tokens, per row: id, its logprob, and its alternatives (None when not asked)."""

    ids: list[int]
    logprobs: list[float]
    top: list[TopLogprobs | None]


@dataclass
class PendingSampled:
    """A sampling's results on their way to the host: ``packed`` [B, 2 + 2k] float64 (id, logprob,
    k alternative ids, their logprobs) is a pinned host tensor that a copy queued on the device's
    stream fills; ``ready`` is recorded after it (None on a CPU, where it is filled already).
    ``ids`` [B] stay on the device, where the next decode step reads them (an overlapped
    scheduler launches it before the host has seen them)."""

    packed: torch.Tensor
    ready: torch.cuda.Event | None
    num_top: tuple[int, ...]
    k: int
    ids: torch.Tensor

    @classmethod
    def none(cls) -> PendingSampled:
        """Nothing sampled (a prefill step whose chunks all go on)."""
        empty = torch.empty((0, 2))
        return cls(empty, None, (), 0, empty[:, 0].long())

    def result(self) -> Sampled:
        """Wait for the copy (only this thread waits; the GIL is released meanwhile), then the lists."""
        if self.ready is not None:
            self.ready.synchronize()
        host = self.packed.tolist()
        wants = self.num_top or (0,) * len(host)
        return Sampled(
            [int(row[0]) for row in host],
            [row[1] for row in host],
            [_top_of(row, n, self.k) for row, n in zip(host, wants)],
        )


@dataclass(frozen=True)
class RowParams:
    """The per-row tensors that follow from the requests' parameters alone, not from their
    progress: the same for every step of an unchanged batch, so the runner keeps them."""

    greedy: torch.Tensor  # [B] bool
    temperature: torch.Tensor  # [B] fp32
    top_p: torch.Tensor  # [B] fp32
    min_p: torch.Tensor  # [B] fp32
    top_k: torch.Tensor  # [B] int64, vocab size when disabled
    all_greedy: bool
    num_top: tuple[int, ...]  # [B] on the host: alternatives each row wants (0: none)

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> RowParams:
        greedy = [p.is_greedy for p in params]
        floats = torch.tensor(
            [
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                [p.top_p for p in params],
                [p.min_p for p in params],
                [float(g) for g in greedy],
            ],
            dtype=torch.float32,
        ).to(device, non_blocking=True)
        return cls(
            greedy=floats[3] > 0,
            temperature=floats[0],
            top_p=floats[1],
            min_p=floats[2],
            top_k=torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], dtype=torch.int64).to(
                device, non_blocking=True
            ),
            all_greedy=all(greedy),
            num_top=tuple(min(p.top_logprobs, vocab_size) for p in params),
        )


@dataclass(frozen=True)
class SamplingBatch:
    fixed: RowParams  # from the parameters alone (kept across steps by the runner)
    seeded: torch.Tensor | None = None  # [S] int64: batch rows with a seed (sampling ones)
    seed_keys: torch.Tensor | None = None  # [S] int64: 32-bit key of (seed, output index)
    penalties: PenaltyBatch | None = None  # None: no row has penalties or min_new_tokens pending
    rows: torch.Tensor | None = None  # [B] int64 request-table rows (for TokenCounts.add)
    grammar: GrammarMask | None = None  # constrained rows' allowed tokens (worker.runner.grammar)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device,
        rows: Sequence[int] | None = None,
        output_lens: Sequence[int] | None = None,
        fixed: RowParams | None = None,
        grammar: GrammarMask | None = None,
    ) -> SamplingBatch:
        """``rows``: the requests' table rows (needed for penalties and counting);
        ``output_lens``: tokens each already generated (the index being sampled);
        ``fixed``: ``RowParams.build`` of these same ``params``, kept from an earlier step."""
        fixed = fixed or RowParams.build(params, vocab_size, device)
        output_lens = list(output_lens) if output_lens is not None else [0] * len(params)
        seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.is_greedy]
        row_ids = _device_ints(rows, device) if rows is not None else None
        penalties = None
        if row_ids is not None:
            penalties = PenaltyBatch.build(params, row_ids, output_lens, device)
        elif any(p.has_penalties or p.min_new_tokens for p in params):
            raise ValueError("penalties and min_new_tokens need the requests' table rows")
        return cls(
            fixed=fixed,
            seeded=_device_ints(seeded, device) if seeded else None,
            seed_keys=_device_ints([seed_key(params[i].seed, output_lens[i]) for i in seeded], device)
            if seeded
            else None,
            penalties=penalties,
            rows=row_ids,
            grammar=grammar,
        )


def _device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64).to(device, non_blocking=True)


def sample(logits: torch.Tensor, batch: SamplingBatch, counts: TokenCounts | None = None) -> Sampled:
    """``launch_sample``, waited for: the step's tokens on the host."""
    return launch_sample(logits, batch, counts).result()


def launch_sample(logits: torch.Tensor, batch: SamplingBatch, counts: TokenCounts | None = None) -> PendingSampled:
    """logits: [B, V] fp32 -> token ids, their log-probabilities and the top alternatives,
    queued on the device; nothing here waits for it (``PendingSampled.result`` does).

    Every log-probability (chosen and alternatives) is of the penalised,
    tempered distribution ``log_softmax(penalised logits / temperature)``
    (temperature 1 for greedy rows), before top-k/top-p/min-p filtering: the
    alternatives are ranked on the same scale as the chosen token's logprob.
    With ``counts`` (and ``batch.rows``), the sampled tokens are counted for
    the next step's penalties; ``logits`` itself is never modified. A grammar's
    mask comes first (on a copy): every logprob is then of the constrained
    distribution, and a forbidden token can never be drawn (-inf stays -inf
    through penalties, temperature and the filters).
    """
    if batch.grammar is not None:
        logits = batch.grammar.apply(logits)
    if batch.penalties is not None:
        if counts is None:
            raise ValueError("this batch has penalties: pass the TokenCounts")
        logits = counts.apply(logits, batch.penalties)
    # Greedy rows have temperature 1: an all-greedy batch skips a [B, V] pass.
    scaled = logits if batch.fixed.all_greedy else logits / batch.fixed.temperature[:, None]
    ids = logits.argmax(dim=-1)
    log_z = _log_normaliser(scaled, ids)  # [B, 1]: log_softmax(x) = x - log_z
    if not batch.fixed.all_greedy:
        ids = torch.where(batch.fixed.greedy, ids, _sample_filtered(scaled, batch))
    if counts is not None and batch.rows is not None:
        counts.add(batch.rows, ids)
    chosen = scaled.gather(1, ids[:, None]) - log_z  # [B, 1]
    # [B, 2 + 2k]: id, logprob, k alternative ids, their logprobs (k = the batch's largest ask; ids
    # are exact in float64), so everything comes back in one copy.
    parts = [ids[:, None].to(torch.float64), _finite(chosen.to(torch.float64))]
    k = max(batch.fixed.num_top, default=0)
    if k:
        top_ids, top_values = _top_with_chosen_first(scaled, ids, k)  # sorted, most likely first
        parts += [top_ids.to(torch.float64), _finite((top_values - log_z).to(torch.float64))]
    packed = torch.cat(parts, dim=1)
    if not packed.is_cuda:
        return PendingSampled(packed, None, batch.fixed.num_top, k, ids)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)  # the one copy, queued behind the step's kernels
    ready = torch.cuda.Event()
    ready.record()
    return PendingSampled(host, ready, batch.fixed.num_top, k, ids)


def _top_with_chosen_first(scaled: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k most likely tokens [B, k] and their scaled logits, where the chosen token ranks
    above the tokens tied with it (and so is never left out for one of them): bf16 logits tie often,
    and ``topk`` orders ties as it likes, which listed another token of a greedy row's logprob first
    or dropped the chosen one. Ranked on the chosen logit raised to the next float up, reported as is."""
    chosen = scaled.gather(1, ids[:, None])
    ranked = scaled.scatter(1, ids[:, None], torch.nextafter(chosen, torch.full_like(chosen, float("inf"))))
    top_ids = ranked.topk(k, dim=-1).indices
    return top_ids, scaled.gather(1, top_ids)


def _log_normaliser(scaled: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row [B, 1]. On CUDA one reduction, where log_softmax would write a
    [B, V] fp32 tensor and read it again (0.25 GB a step at B = 512, V = 128k). torch's CPU
    logsumexp is ~10x slower than its log_softmax (6 ms vs 0.5 for [1024, 256], one thread),
    so the CPU reads it off log_softmax at each row's argmax (finite: never masked)."""
    if scaled.is_cuda:
        return torch.logsumexp(scaled, dim=-1, keepdim=True)
    at_max = ids[:, None]
    return scaled.gather(1, at_max) - torch.log_softmax(scaled, dim=-1).gather(1, at_max)


def _top_of(row: list[float], n: int, k: int) -> TopLogprobs | None:
    """A host row's first ``n`` of ``k`` alternatives (None when the request asked for none)."""
    if not n:
        return None
    return [(int(row[2 + i]), row[2 + k + i]) for i in range(n)]


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= batch.fixed.top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= batch.fixed.top_p[:, None], 0.0)
    # min_p: drop tokens below min_p x the most likely one (which always stays). The
    # ratio does not change under renormalisation, so the order of the filters is free.
    probs = probs.masked_fill(probs < batch.fixed.min_p[:, None] * probs[:, :1], 0.0)
    noise = torch.empty_like(probs).exponential_(1.0).clamp_min_(MIN_NOISE)
    if batch.seeded is not None:
        # Noise is keyed by token id, so it is gathered into this row's sorted order.
        keyed = seeded_noise(batch.seed_keys, scaled.shape[-1])
        noise[batch.seeded] = keyed.gather(1, order[batch.seeded])
    race = probs / noise
    return order.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]


# ---- counter-based noise: lowbias32 (C. Wellons), a bijection on 32-bit values ----


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) without int64 overflow (tensors or ints)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def hash32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int, output_index: int) -> int:
    """The 32-bit key of one sampling step of a seeded request (any int seed)."""
    seed &= (1 << 64) - 1
    key = hash32(hash32(seed & M32) ^ (seed >> 32))
    return hash32(key ^ hash32((output_index * GOLDEN) & M32))


def seeded_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[S, V] fp32 Exp(1) noise, entry (s, t) a function of (keys[s], t) only.

    ``key + t * GOLDEN`` is distinct for distinct t (GOLDEN is odd) and hash32
    is a bijection, so no two tokens of a row share a value; 24 bits of it
    make u in (0, 1], never 0 (1 for the top value only: clamped below).
    """
    tokens = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)[None, :]
    x = (keys[:, None] + tokens * GOLDEN) & M32
    bits = hash32(hash32(x)) >> 8
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    # bits = 2**24 - 1 rounds to u = 1 in fp32 (x.5 past 2**24 is not representable): noise 0, and a
    # token filtered out (p = 0: top-k/p, a grammar) would race 0 / 0 = NaN, which argmax picks.
    return (-torch.log(u)).clamp_min_(MIN_NOISE)


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    """Logprobs a chunk can carry: -inf and NaN (a row the door's bounds should have kept finite)
    become FLOOR_LOGPROB, never JSON's null, which no reader takes."""
    return logprobs.nan_to_num(nan=FLOOR_LOGPROB, posinf=0.0, neginf=FLOOR_LOGPROB).clamp_min(FLOOR_LOGPROB)
