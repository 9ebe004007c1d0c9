"""The producer's /metrics shows router.order.ordering's counters: depth per class and per tenant,
tokens dispatched per tenant (the same numbers every router's own endpoint shows)."""

from __future__ import annotations

from shared.keys import class_tenant_field


async def test_class_and_tenant_depth_and_tokens(scrape, aredis, keys):
    await aredis.hset(keys.tenant_queued(), mapping={class_tenant_field(0, "a"): 2, class_tenant_field(1, "b:x"): 3})
    await aredis.hset(keys.tenant_served(), mapping={class_tenant_field(0, "a"): 120})
    s = await scrape()
    assert s[("lightq:queue_class_depth", (("priority", "0"),))] == 2
    assert s[("lightq:queue_class_depth", (("priority", "1"),))] == 3
    assert s[("lightq:queue_tenant_depth", (("priority", "1"), ("tenant", "b:x")))] == 3
    assert s[("lightq:tenant_dispatched_tokens_total", (("priority", "0"), ("tenant", "a")))] == 120


def test_top_shows_classes_and_tenants():
    from lightq.top import shares
    from producer.monitoring.cluster import ClusterSnapshot

    assert shares(ClusterSnapshot(ts_ms=0)) == []  # nothing ordered yet: no lines
    snap = ClusterSnapshot(ts_ms=0, tenant_queued={(0, "a"): 2, (1, "[b]"): 5}, tenant_served={(0, "a"): 40})
    classes, tenants = shares(snap)
    assert "0: [bold]2[/]" in classes and "1: [bold]5[/]" in classes
    assert tenants.index("a (class 0) 2 queued, 40 tok") < tenants.index("(class 1) 5 queued, 0 tok")
    assert "\\[b]" in tenants  # a tenant name is text, never markup
