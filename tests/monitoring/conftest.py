"""Monitoring fixtures: the producer tests' app, client, async Redis and fake worker."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.producer.conftest import app, aredis, client, settings, tokenizer, worker  # noqa: F401


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def refresh(app) -> None:
    """A read of the cluster view now (on its thread, as every --metrics_refresh_s), not waiting for one."""
    await app.state.cluster_view.refresh_now()


@pytest.fixture
def scrape(client, app):
    async def scrape_once() -> dict[tuple[str, tuple], float]:
        await refresh(app)
        response = await client.get("/metrics")
        assert response.status_code == 200
        return parse(response.text)

    return scrape_once
