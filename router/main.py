"""``lightq router``: one router process (and its metrics endpoint with ``--metrics_port``)."""

from __future__ import annotations

from collections.abc import Sequence

from router.metrics import MeteredRouter, RouterCollector, RouterMetrics
from shared.config import RouterSettings
from shared.flags import from_argv
from shared.metrics_server import serve_metrics
from shared.redis import sync_client
from shared.service import default_id, setup_logging, stop_on_signals


def run(settings: RouterSettings) -> None:
    setup_logging()
    client = sync_client(settings.redis)
    router_id = default_id(settings.router_id)
    metrics = RouterMetrics(router_id)
    router = MeteredRouter(settings, client, router_id, metrics=metrics)
    metrics.registry.register(RouterCollector(router))
    server = serve_metrics(metrics.registry, settings.metrics_port)
    stop_on_signals(router.stop_event)
    try:
        router.run()
    finally:
        if server is not None:
            server.shutdown()
        client.close()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m router.main [flags]``: the flags ``lightq router`` takes (``--help`` lists them)."""
    run(from_argv(RouterSettings, "python -m router.main", __doc__, argv))


if __name__ == "__main__":
    main()
