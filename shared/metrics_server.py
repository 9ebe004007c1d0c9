"""The Prometheus endpoint of a router or worker process (``--metrics_port``)."""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("lightq.metrics")

PORT_TRIES = 64


def serve_metrics(registry: CollectorRegistry, port: int) -> WSGIServer | None:
    """Serve ``registry`` on ``port``, or the next free port above it (several workers on
    one host given one port); None when ``port`` is 0."""
    if not port:
        return None
    for candidate in range(port, min(port + PORT_TRIES, 65536)):
        try:
            server, _thread = start_http_server(candidate, registry=registry)
        except OSError:
            continue
        log.info("metrics on :%d/metrics", candidate)
        return server
    raise OSError(f"no free metrics port in {port}..{port + PORT_TRIES - 1}")
