"""One forward step's inputs: packed new tokens plus the TokenAttention indexes.

Index invariants (B requests, T = sum(q_lens) new tokens, packed, no padding):

| tensor       | shape | meaning                                                        |
|--------------|-------|----------------------------------------------------------------|
| input_ids    | [T]   | new token ids, request b's at q_starts[b] .. q_starts[b]+q_lens[b]-1 |
| positions    | [T]   | absolute position of each new token (cached_lens[b] + i)       |
| out_slots    | [T]   | KV pool slot each new token's K/V is written to                |
| req_rows     | [B]   | row of request b in req_table                                  |
| cached_lens  | [B]   | tokens of b already in the pool before this step               |
| seq_lens     | [B]   | cached_lens + q_lens: tokens of b in the pool after this step  |
| q_starts     | [B]   | exclusive cumsum of q_lens                                     |
| q_lens       | [B]   | new tokens of b in this step (1 for a decode)                  |
| lora_slots   | [B]   | LoRA adapter slot of request b (0: none); None: no adapter loaded |
| req_table    | [R+1, L] | req_table[req_rows[b], p] = pool slot of b's token at position p,   |
|              |       | for p < seq_lens[b]; written before the forward                |

A decode step is the case q_lens == 1 everywhere (``is_decode``); a chunked
or prefix-cached prefill is the case cached_lens > 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_slots: torch.Tensor
    req_rows: torch.Tensor
    cached_lens: torch.Tensor
    seq_lens: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    req_table: torch.Tensor
    max_seq_len: int
    max_q_len: int
    is_decode: bool
    # Packed tokens whose logits the forward returns, in order; None: each request's last new token
    # (what is sampled). Prompt log-probabilities ask for every token of a request's chunk.
    logit_index: torch.Tensor | None = None
    # [B] int32: each request's LoRA adapter slot (worker.lora.adapter_set; 0: none). None: the
    # worker serves no adapter. A decode graph reads it from its static inputs (cuda_graphs.py).
    lora_slots: torch.Tensor | None = None

    @property
    def num_requests(self) -> int:
        return int(self.req_rows.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] index into the packed tokens of each request's last new token."""
        return self.q_starts + self.q_lens - 1

    @property
    def output_index(self) -> torch.Tensor:
        """[N] the packed tokens whose logits the forward returns (``logit_index``, or each last)."""
        return self.logit_index if self.logit_index is not None else self.last_token_index
