"""The synthetic ShareGPT-like workload (docs: shared notes, performance.md §2.2).

Lengths are drawn, not text: input ~ round(LogNormal(5.08, 1.0)), output ~
round(LogNormal(4.79, 1.0)), filtered as vLLM filters ShareGPT (4 <= input
<= 1024, output >= 4, input + output <= 2048), rejected pairs redrawn.
Means land near 220 input and 190 output tokens.
"""

from __future__ import annotations

import numpy as np


def sharegpt_lengths(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    pairs: list[tuple[int, int]] = []
    while len(pairs) < n:
        inp = int(round(rng.lognormal(5.08, 1.0)))
        out = int(round(rng.lognormal(4.79, 1.0)))
        if 4 <= inp <= 1024 and out >= 4 and inp + out <= 2048:
            pairs.append((inp, out))
    return pairs


def describe(values: list[int]) -> str:
    arr = np.array(values)
    return f"mean {arr.mean():.1f} median {np.median(arr):.0f} p90 {np.percentile(arr, 90):.0f} max {arr.max()}"
