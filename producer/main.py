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

Client addresses: uvicorn trusts ``X-Forwarded-For`` from 127.0.0.1 unless told
otherwise, so any local client could claim any address and step around the
wrong-key throttle (``producer.edge.front_door``). Here its proxy-headers
middleware is on only with ``--forwarded_allow_ips``, for the proxies named
there (``server_options``); otherwise the connection's address is the client's.

Access log: uvicorn's, one line per request, except a health probe that asks for quiet
(``GET /health?quiet=1``) and gets its 200 (``QuietProbes``): ``lightq serve`` polls that while its
workers load, and its 116 lines in one start buried the log. A failing probe is still logged.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import parse_qs

import uvicorn
import uvicorn.config
from pydantic import SecretStr

from producer.app import MULTIPROC_ENV, PARENT_ENV, create_app
from shared.flags import as_env, flat_fields, from_argv
from shared.producer_settings import ProducerSettings, default_producers
from shared.service import setup_logging

GRACEFUL_SHUTDOWN_S = 5
WORKER_HEALTHCHECK_S = 60
APP_FACTORY = "producer.app:app_from_env"


def run(settings: ProducerSettings) -> None:
    """Serve the producer until interrupted (the launcher's entry point)."""
    setup_logging()
    count = settings.producers or default_producers()
    if count == 1:
        uvicorn.run(create_app(settings), **server_options(settings))
        return
    with multiprocess_dir() as folder:
        # The children are spawned (fresh interpreters): they inherit this environment, and
        # prometheus_client reads MULTIPROC_ENV when they import it.
        os.environ.update(settings_env(settings))
        os.environ[MULTIPROC_ENV] = folder
        os.environ[PARENT_ENV] = str(os.getpid())  # the children stop when this process dies
        uvicorn.run(APP_FACTORY, factory=True, workers=count, **server_options(settings))


def server_options(settings: ProducerSettings) -> dict:
    """uvicorn's options for the producer, one process or N."""
    return {
        "host": settings.host,
        "port": settings.port,
        "log_level": "info",
        # Open streams would hold a shutdown forever; after the grace they are cut (and cancelled).
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        # X-Forwarded-For / -Proto only from the proxies named (uvicorn's default trusts 127.0.0.1).
        "proxy_headers": bool(settings.forwarded_allow_ips),
        "forwarded_allow_ips": settings.forwarded_allow_ips or None,
        "log_config": access_log_config(),
        # N processes: uvicorn's supervisor kills a child that leaves its ping unanswered this long;
        # the default 5 s is shorter than a child's imports take on a busy machine (its answering
        # thread waits for the GIL), and on 2 loaded cores every child was killed at start, again
        # and again (uvicorn 0.55).
        "timeout_worker_healthcheck": WORKER_HEALTHCHECK_S,
    }


HEALTH_PATHS = ("/health", "/healthz")


class QuietProbes(logging.Filter):
    """Drops uvicorn's access-log line of a ``GET /health?quiet=1`` answered 200; keeps every other
    line. uvicorn logs ``(client, method, path with query, http version, status)`` as the record's args."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _, method, target, _, status = args
        path, _, query = str(target).partition("?")
        quiet = method == "GET" and status == 200 and path in HEALTH_PATHS
        return not (quiet and parse_qs(query).get("quiet") == ["1"])


def access_log_config() -> dict:
    """uvicorn's own logging configuration with ``QuietProbes`` on its access logger. Named by its
    import path: N producers are spawned processes that configure their logging from this dict."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["filters"] = {"quiet_probes": {"()": "producer.main.QuietProbes"}}
    config["loggers"]["uvicorn.access"]["filters"] = ["quiet_probes"]
    return config


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
    run(from_argv(ProducerSettings, "python -m producer.main", __doc__, argv))


if __name__ == "__main__":
    main()
