"""``python -m producer.main [--port 8000 --redis_url ... --producers N]``: settings once, then uvicorn.

Flags are the ones ``lightq producer`` takes (generated from the settings);
flags left out fall back to ``LIGHTQ_*`` environment variables, then defaults.

``--producers N`` > 1 (0, the default: ``default_producers()``, a quarter of
the cores, 1 to 4) runs N processes behind the one port with uvicorn's
own supervisor: this process binds the socket, spawns N children that
accept on it (the kernel hands each connection to one of them), restarts a
child that dies, and on SIGTERM/SIGINT stops them all (each finishes its
open requests for ``GRACEFUL_SHUTDOWN_S``); a child whose supervisor dies,
even by SIGKILL, stops too (``app.die_with_parent``). The producer is stateless
(every request lives in Redis), so any child may answer any request. The
children build their settings from the environment this process sets
(``settings_env``: the settings as ``LIGHTQ_*`` variables), and share
their counters and histograms through prometheus_client's multiprocess
files in a temporary folder made here and removed at exit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import uvicorn
from pydantic import SecretStr

from producer.app import MULTIPROC_ENV, PARENT_ENV, create_app
from shared.config import ProducerSettings, default_producers
from shared.flags import add_flags, as_env, build, flat_fields, given
from shared.service import setup_logging

GRACEFUL_SHUTDOWN_S = 5
APP_FACTORY = "producer.app:app_from_env"


def run(settings: ProducerSettings) -> None:
    """Serve the producer until interrupted (the launcher's entry point)."""
    setup_logging()
    count = settings.producers or default_producers()
    if count == 1:
        # Open streams would hold a shutdown forever; after the grace they are cut (and cancelled).
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        return
    with multiprocess_dir() as folder:
        # The children are spawned (fresh interpreters): they inherit this environment, and
        # prometheus_client reads MULTIPROC_ENV when they import it.
        os.environ.update(settings_env(settings))
        os.environ[MULTIPROC_ENV] = folder
        os.environ[PARENT_ENV] = str(os.getpid())  # the children stop when this process dies
        uvicorn.run(
            APP_FACTORY,
            factory=True,
            workers=count,
            host=settings.host,
            port=settings.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )


@contextmanager
def multiprocess_dir() -> Iterator[str]:
    """An empty folder for the children's metric files, removed when they are gone."""
    folder = tempfile.mkdtemp(prefix="lightq-producer-metrics-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def settings_env(settings: ProducerSettings) -> dict[str, str]:
    """Every setting as its ``LIGHTQ_*`` variable: ``build(ProducerSettings, {})`` in a child
    with this environment gives back ``settings`` (secrets included, in the clear)."""
    flags = {}
    for flag, (parent, name, _) in flat_fields(ProducerSettings).items():
        value = getattr(settings if parent is None else getattr(settings, parent), name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is not None:
            flags[flag] = value
    return as_env(flags)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightq-producer", description=__doc__)
    add_flags(parser, ProducerSettings)
    args = parser.parse_args(None if argv is None else list(argv))
    run(build(ProducerSettings, given(args)))


if __name__ == "__main__":
    main()
