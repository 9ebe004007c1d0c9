"""``python -m producer.main [--port 8000 --redis_url ...]``: settings once, then uvicorn.

Flags are the ones ``lightq producer`` takes (generated from the settings);
flags left out fall back to ``LIGHTQ_*`` environment variables, then defaults.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import uvicorn

from shared.flags import add_flags, build, given
from producer.app import create_app
from shared.config import ProducerSettings
from shared.service import setup_logging

GRACEFUL_SHUTDOWN_S = 5


def run(settings: ProducerSettings) -> None:
    """Serve the producer until interrupted (the launcher's entry point)."""
    setup_logging()
    # Open streams would hold a shutdown forever; after the grace they are cut (and cancelled).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightq-producer", description=__doc__)
    add_flags(parser, ProducerSettings)
    args = parser.parse_args(None if argv is None else list(argv))
    run(build(ProducerSettings, given(args)))


if __name__ == "__main__":
    main()
