"""/metrics shows at most ``--metrics_tenants`` tenants per class and ``other`` (issue 34 item 2):
queued requests of the rest summed into ``other``, tokens dispatched only for the top ones and
the overflow tenant's own counter (a summed counter could go down)."""

from __future__ import annotations

from shared.keys import class_tenant_field
from shared.schemas import OTHER_TENANT
from shared.tenant_series import top_tenants

DEPTH, TOKENS = "lightq:queue_tenant_depth", "lightq:tenant_dispatched_tokens_total"


def tenant_samples(samples: dict, name: str) -> dict[tuple[str, str], float]:
    return {(dict(labels)["priority"], dict(labels)["tenant"]): v for (n, labels), v in samples.items() if n == name}


async def test_metrics_show_the_top_tenants_and_other(scrape, aredis, keys, app):
    assert app.state.metrics.metrics_tenants == 16  # the default
    queued = {class_tenant_field(0, f"u{i}"): i + 1 for i in range(40)}  # u39 has the most
    served = {class_tenant_field(0, f"u{i}"): 1000 - i for i in range(40)}  # u0 has the most
    await aredis.hset(keys.tenant_queued(), mapping={**queued, class_tenant_field(1, "solo"): 7})
    await aredis.hset(keys.tenant_served(), mapping={**served, class_tenant_field(0, OTHER_TENANT): 5})
    s = await scrape()
    depth = tenant_samples(s, DEPTH)
    assert set(depth) == {("0", f"u{i}") for i in range(24, 40)} | {("0", OTHER_TENANT), ("1", "solo")}
    assert depth[("0", OTHER_TENANT)] == sum(range(1, 25))  # u0..u23's, summed
    assert s[("lightq:queue_class_depth", (("priority", "0"),))] == sum(range(1, 41))  # the class: everyone
    tokens = tenant_samples(s, TOKENS)
    assert set(tokens) == {("0", f"u{i}") for i in range(16)} | {("0", OTHER_TENANT)}
    assert tokens[("0", OTHER_TENANT)] == 5  # the overflow tenant's own counter, nothing taken from others


def test_top_tenants_cut_each_class_on_its_own():
    values = {(0, "a"): 5, (0, "b"): 3, (0, "c"): 3, (0, OTHER_TENANT): 1, (2, "z"): 9}
    assert top_tenants(values, 2, sum_rest=True) == {(0, "a"): 5, (0, "b"): 3, (0, OTHER_TENANT): 4, (2, "z"): 9}
    assert top_tenants(values, 2, sum_rest=False) == {(0, "a"): 5, (0, "b"): 3, (0, OTHER_TENANT): 1, (2, "z"): 9}
    assert top_tenants(values, 0, sum_rest=True) == {(0, OTHER_TENANT): 12, (2, OTHER_TENANT): 9}
    assert top_tenants(values, 0, sum_rest=False) == {(0, OTHER_TENANT): 1}
