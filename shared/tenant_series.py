"""Which tenants get /metrics series of their own: per priority class the ``k`` with the largest
values, and ``other`` (``--metrics_tenants``), so a client sending a new OpenAI ``user`` with every
request cannot add series without bound. The producer's and the router's ``/metrics`` both use it.

Gauges (requests queued) put every other tenant's value in ``other``. Counters (tokens dispatched)
cannot: a tenant entering the top ``k`` would take its tokens out of a summed ``other``, which a
counter must never do (Prometheus reads a drop as a restart). Their ``other`` is the overflow
tenant's own counter (``router.order.ordering``, ``router.order.tenant_records``: tenants past
``--max_tenants`` and idle tenants folded there), and the tenants outside the top ``k`` are left
out; every series shown only ever grows.
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.schemas import OTHER_TENANT


def top_tenants(values: Mapping[tuple[int, str], int], k: int, sum_rest: bool) -> dict[tuple[int, str], int]:
    """``(priority, tenant) -> value`` cut to at most ``k + 1`` series per class (ties by name)."""
    by_class: dict[int, list[tuple[str, int]]] = {}
    for (priority, tenant), value in values.items():
        if tenant != OTHER_TENANT:
            by_class.setdefault(priority, []).append((tenant, value))
    out: dict[tuple[int, str], int] = {}
    for priority in {priority for priority, _ in values}:
        rows = sorted(by_class.get(priority, []), key=lambda row: (-row[1], row[0]))
        out.update(((priority, tenant), value) for tenant, value in rows[:k])
        other = values.get((priority, OTHER_TENANT), 0) + (sum(v for _, v in rows[k:]) if sum_rest else 0)
        if (priority, OTHER_TENANT) in values or (sum_rest and rows[k:]):
            out[(priority, OTHER_TENANT)] = other
    return out
