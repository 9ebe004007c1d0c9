"""Which of the workers a request fits gets it: by load, and by what their prefix caches hold.

``router.admission.views`` asks these for each decision, with each worker's use ratio now and the
check of the request against its view (``router.admission.worker_view``).

Workers are visited in
order of their projected use now (use / pool), least loaded first, and of
the first ``CHOICES`` the request fits, the one with the lowest resulting
ratio wins (a small pool that a big request would fill loses to a larger
one). So a decision runs about ``CHOICES`` checks, not one per worker: at 32
workers, checking every one was three quarters of the router's time
(bench/RESULTS.md, the scale test). When the least loaded do not fit, the
walk goes on, so a request waits only if no worker can take it.

Workers publish what their prefix caches hold (``WorkerLoad.prefixes``,
hashes of prefixes at ``shared.prefix_hash`` boundaries), so the choice is
cache-aware (``cache_aware_fit``): the workers holding the longest prefix of
the request's prompt are asked too, and a hit is traded against load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

CHOICES = 2
# Cache-aware choice (``cache_aware_fit``): how many of the workers with the longest hits are asked
# besides the least loaded, and what a whole-prompt hit is worth in use ratio (see there).
HIT_CHOICES = 2
HIT_WEIGHT = 0.5


def least_loaded_fit(
    uses: Mapping[str, float], ratio: Callable[[str], float | None], choices: int = CHOICES
) -> str | None:
    """``uses``: worker -> use ratio now; ``ratio(worker)``: the ratio with the request, None if it
    does not fit. Ties go to the less loaded, then to the lesser id."""
    fitting: list[tuple[float, int, str]] = []
    for _, worker_id in sorted((use, worker_id) for worker_id, use in uses.items()):
        result = ratio(worker_id)
        if result is not None:
            fitting.append((result, len(fitting), worker_id))
            if len(fitting) == choices:
                break
    return min(fitting)[2] if fitting else None


def cache_aware_fit(
    uses: Mapping[str, float],
    hits: Mapping[str, float],
    ratio: Callable[[str], float | None],
    choices: int = CHOICES,
) -> str | None:
    """``least_loaded_fit``'s walk, plus the ``HIT_CHOICES`` workers with the longest hits
    (``hits``: worker -> cached share of the prompt, 0..1); the request fits some of them, and
    the lowest ``ratio - HIT_WEIGHT * hit`` wins.

    The trade-off: a hit saves the prefill of its tokens (the prompt's time to first token and
    the batch's compute), load costs every request there decode time and room. At 0.5, a worker
    holding the whole prompt wins over an empty one until its projected use is half the pool
    above it; beyond that the request goes to the less loaded one, so a hot prefix spreads to a
    second worker when one cannot serve all of it, and a short hit barely moves the choice. A
    worker the request does not fit is never chosen, however long its hit: the request goes
    elsewhere at once instead of waiting for it. Without hits this is ``least_loaded_fit``."""
    asked: dict[str, tuple[float, int] | None] = {}  # worker -> (ratio, order asked), None: no fit

    def ask(worker_id: str) -> bool:
        if worker_id not in asked:
            result = ratio(worker_id)
            asked[worker_id] = None if result is None else (result, len(asked))
        return asked[worker_id] is not None

    for worker_id in sorted(hits, key=lambda w: (-hits[w], uses[w], w))[:HIT_CHOICES]:
        ask(worker_id)
    fitting = 0
    for _, worker_id in sorted((use, worker_id) for worker_id, use in uses.items()):
        fitting += ask(worker_id)
        if fitting == choices:
            break
    scored = [
        (answer[0] - HIT_WEIGHT * hits.get(worker_id, 0.0), answer[0], answer[1], worker_id)
        for worker_id, answer in asked.items()
        if answer is not None
    ]
    return min(scored)[3] if scored else None


# Why a worker was chosen: it holds a prefix of the prompt (a LoRA request: its adapter); others did
# but load won (a LoRA miss: others would lose a less popular adapter); nobody held any (least
# loaded; a LoRA miss: the worker losing the least popular adapter, ``router.lora.adapter_popularity``);
# none could take it (the request waits).
Reason = Literal[
    "prefix_hit", "load_over_hit", "adapter_hit", "load_over_adapter", "adapter_spare", "least_loaded", "wait"
]


def reason(chosen: str | None, hits: Mapping[str, float], adapter: bool = False) -> Reason:
    if chosen is None:
        return "wait"
    if chosen in hits:
        return "adapter_hit" if adapter else "prefix_hit"
    if not hits:
        return "least_loaded"
    return "load_over_adapter" if adapter else "load_over_hit"
