"""Drive a lightq model through the real pool: TokenPool slots, ReqTable rows, ForwardBatch.

``PoolRunner.step`` takes {request id: new token ids} and works out
everything the scheduler would: allocates a table row for a new request,
pool slots for the new tokens, writes the table, then runs one forward over
all requests packed together. One new token each is a decode step.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from worker.engine.token_pool import TokenPool
from worker.model.attention import TorchAttention
from worker.model.forward_batch import ForwardBatch
from worker.model.kv_cache import KVCache
from worker.runner.req_table import ReqTable


def build_batch(
    table: torch.Tensor, rows: list[int], cached: list[int], new: list[list[int]], slots: list[np.ndarray]
) -> ForwardBatch:
    """The ForwardBatch of requests at ``rows`` with ``cached`` tokens pooled, adding ``new``."""
    q_lens = [len(ids) for ids in new]
    seq_lens = [c + n for c, n in zip(cached, q_lens)]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        input_ids=t([i for ids in new for i in ids]),
        positions=t([c + i for c, n in zip(cached, q_lens) for i in range(n)]),
        out_slots=torch.from_numpy(np.concatenate(slots)).long(),
        req_rows=t(rows),
        cached_lens=t(cached),
        seq_lens=t(seq_lens),
        q_starts=t(np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist()),
        q_lens=t(q_lens),
        req_table=table,
        max_seq_len=max(seq_lens),
        max_q_len=max(q_lens),
        is_decode=all(n == 1 for n in q_lens),
    )


class PoolRunner:
    def __init__(self, model, num_slots: int = 512, max_requests: int = 8, max_len: int = 256):
        self.cache = KVCache(model.num_layers, num_slots, model.num_kv_heads, model.head_dim, model.dtype, "cpu")
        model.set_backend(TorchAttention(self.cache))
        self.model = model
        self.pool = TokenPool(num_slots)
        self.table = ReqTable(max_requests, max_len, self.cache.hold_slot, "cpu")
        self.rows: dict[object, int] = {}
        self.lengths: dict[object, int] = {}

    def step(self, new_tokens: dict[object, list[int]]) -> torch.Tensor:
        """Run one forward; returns logits [B, vocab] in ``new_tokens``' order."""
        rows, cached, new, slots = [], [], [], []
        for rid, ids in new_tokens.items():
            if rid not in self.rows:
                self.rows[rid] = self.table.allocate_row()
                self.lengths[rid] = 0
            s = self.pool.allocate(len(ids))
            self.table.write(self.rows[rid], self.lengths[rid], s)
            rows.append(self.rows[rid])
            cached.append(self.lengths[rid])
            new.append(list(ids))
            slots.append(s)
            self.lengths[rid] += len(ids)
        return self.model(build_batch(self.table.table, rows, cached, new, slots))

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Packed prefill of all prompts, then batched greedy decode steps."""
        logits = self.step(dict(enumerate(prompts)))
        out = [[int(t)] for t in logits.argmax(-1)]
        for _ in range(max_new_tokens - 1):
            logits = self.step({i: [seq[-1]] for i, seq in enumerate(out)})
            for seq, t in zip(out, logits.argmax(-1)):
                seq.append(int(t))
        return out


def tiny_gpu_llama() -> transformers.LlamaForCausalLM:
    """The GPU tests' tiny Llama (3 layers, 256 wide, 1,000 tokens), seeded: the same weights each call."""
    config = transformers.LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        max_position_embeddings=1024,
        eos_token_id=0,
        # Peaked logits: a random model with flat ones has near-ties that
        # tf32 (GPU) and fp32 (CPU) break differently (seen at token 21 of 24).
        initializer_range=0.15,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)
