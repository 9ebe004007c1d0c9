"""Workloads whose prompts repeat, for the prefix cache (issue 17), with synthetic token ids.

- ``gsp``: SGLang's generated-shared-prefix workload (``bench_serving.py --dataset-name
  generated-shared-prefix``, its defaults): 64 groups of 16 prompts, each prompt a group's
  2,048-token system prompt followed by a 128-token question of its own, 256 output tokens;
  the 1,024 requests shuffled, so a group's prompts arrive spread over the run.
- ``multiturn``: conversations of several turns, each turn resending the whole history (the
  system prompt, every earlier user message and every earlier reply) plus a new user message,
  as chat clients do. A turn is sent when the previous one has finished; its history holds the
  reply's real token ids (from the stream), so a worker that kept the conversation finds all of
  it cached. Conversations start at the request rate and run side by side.
Token ids are drawn from [3, vocab) (ids below 3 are often special), uniformly at random, so
two prompts share a prefix only where the workload means them to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

Request = tuple[str | list[int], int, int]  # (prompt, prompt tokens, output tokens), as serve_bench's


def gsp_requests(
    seed: int,
    vocab: int,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
) -> list[Request]:
    rng = np.random.default_rng(seed)
    requests: list[Request] = []
    for _ in range(num_groups):
        system = rng.integers(3, vocab, size=system_len).tolist()
        for _ in range(prompts_per_group):
            prompt = system + rng.integers(3, vocab, size=question_len).tolist()
            requests.append((prompt, len(prompt), output_len))
    random.Random(seed).shuffle(requests)
    return requests


@dataclass
class Conversation:
    """One chat: a system prompt, then a user message per turn; ``history`` grows as turns finish."""

    history: list[int]
    user_turns: list[list[int]]
    output_len: int
    replies: list[list[int]] = field(default_factory=list)

    def next_prompt(self) -> list[int]:
        return self.history + self.user_turns[len(self.replies)]

    def finish_turn(self, prompt: list[int], reply: list[int]) -> None:
        self.history = prompt + reply
        self.replies.append(reply)


def conversations(
    seed: int,
    vocab: int,
    num_conversations: int = 32,
    turns: int = 4,
    system_len: int = 512,
    user_len: int = 128,
    output_len: int = 128,
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    return [
        Conversation(
            history=rng.integers(3, vocab, size=system_len).tolist(),
            user_turns=[rng.integers(3, vocab, size=user_len).tolist() for _ in range(turns)],
            output_len=output_len,
        )
        for _ in range(num_conversations)
    ]
