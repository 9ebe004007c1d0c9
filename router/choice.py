"""Which admissible worker gets a request: the least loaded that it fits.

Workers are visited in order of their projected use now (use / pool, as
the admission policy projects it), least loaded first; the request's
admission check runs on them in that order, and of the first ``CHOICES``
it fits, the one with the lowest resulting ratio wins (a small pool that a
big request would fill loses to a larger one). So a decision runs about
``CHOICES`` checks, not one per worker: at 32 workers, checking every one
was three quarters of the router's time (bench/RESULTS.md, the scale test).
When the least loaded do not fit, the walk goes on, so a request waits only
if no worker can take it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

CHOICES = 2


def least_loaded_fit(uses: Mapping[str, float], ratio: Callable[[str], float | None],
                     choices: int = CHOICES) -> str | None:
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
