"""The producer's /metrics shows router.ordering's counters: depth per class and per tenant,
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
