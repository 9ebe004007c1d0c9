"""Request-length workloads for the admission simulator (shared notes, performance.md §2).

Each workload draws (input, output) token counts. The output length is the
request's true length, hidden from every admission policy but the oracle:
clients send ``max_new_tokens`` = the workload's cap and the request stops
at its own EOS, as a chat client with a generous cap does. The cap is the
largest output the distribution produces (the conservative policy's best
case; the Past-Future artifact gave its conservative baseline 12,000, which
``--max_new_tokens 12000`` reproduces).

| name        | input                    | output                         | cap   |
|-------------|--------------------------|--------------------------------|-------|
| sharegpt-o1 | LogNormal, mean ~381     | LogNormal, mean ~2,160, heavy  | 8,192 |
| dist1       | U[32, 4k]                | U[2k, 4k]                      | 4,096 |
| dist2       | U[3k, 5k]                | U[3k, 5k]                      | 5,120 |
| dist3       | U[2k, 4k]                | U[32, 4k]                      | 4,096 |
| sharegpt    | lightq's ShareGPT recipe (means ~220 / ~190)               | 2,048 - input |

The o1-like shape (a lognormal with sigma 1.0 for outputs, 0.8 for inputs,
clipped) is a modelling choice matched to the published means, not the
dataset; ``describe`` prints what a seed actually drew.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

from bench.workloads.sharegpt import describe, sharegpt_lengths

K = 1024


@dataclass(frozen=True)
class Request:
    prompt: int
    output: int  # the true length: EOS comes after this many tokens
    max_new_tokens: int


def _o1(rng: random.Random, cap: int) -> tuple[int, int]:
    # lognormal mean = exp(mu + sigma^2 / 2): mu = ln(mean) - sigma^2 / 2. The output's
    # unclipped mean is 2,360 so that clipping at the cap leaves ~2,160.
    prompt = round(rng.lognormvariate(math.log(381) - 0.32, 0.8))
    output = round(rng.lognormvariate(math.log(2360) - 0.5, 1.0))
    return min(max(prompt, 4), 4 * K), min(max(output, 16), cap)


def _uniform(rng: random.Random, lo_in: int, hi_in: int, lo_out: int, hi_out: int) -> tuple[int, int]:
    return rng.randint(lo_in, hi_in), rng.randint(lo_out, hi_out)


DRAWS = {
    "sharegpt-o1": (8 * K, lambda rng, cap: _o1(rng, cap)),
    "dist1": (4 * K, lambda rng, cap: _uniform(rng, 32, 4 * K, 2 * K, 4 * K)),
    "dist2": (5 * K, lambda rng, cap: _uniform(rng, 3 * K, 5 * K, 3 * K, 5 * K)),
    "dist3": (4 * K, lambda rng, cap: _uniform(rng, 2 * K, 4 * K, 32, 4 * K)),
}
NAMES = [*DRAWS, "sharegpt"]


def stream(name: str, seed: int = 0, max_new_tokens: int | None = None) -> Iterator[Request]:
    """An endless supply of a workload's requests; ``max_new_tokens`` overrides the cap."""
    if name == "sharegpt":
        batch = 0
        while True:  # bench.workloads.sharegpt draws a list at a time
            for p, o in sharegpt_lengths(1000, seed * 1000 + batch):
                yield Request(p, o, max_new_tokens or 2 * K - p)
            batch += 1
    cap, draw = DRAWS[name]
    rng = random.Random(seed * 100 + NAMES.index(name))  # workloads drawn independently
    while True:
        p, o = draw(rng, cap)
        yield Request(p, o, max(max_new_tokens or cap, o))


def requests(name: str, n: int, seed: int = 0, max_new_tokens: int | None = None) -> list[Request]:
    return list(islice(stream(name, seed, max_new_tokens), n))


def cap(name: str, max_new_tokens: int | None = None) -> int:
    """The largest ``max_new_tokens`` the workload's clients send."""
    return max_new_tokens or (2 * K if name == "sharegpt" else DRAWS[name][0])


def summary(reqs: list[Request]) -> str:
    return (
        f"input {describe([r.prompt for r in reqs])}; output {describe([r.output for r in reqs])}; "
        f"max_new_tokens {min(r.max_new_tokens for r in reqs)}-{max(r.max_new_tokens for r in reqs)}"
    )
