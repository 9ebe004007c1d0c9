"""``create_app(settings)``: the producer's FastAPI app, with nothing built at import.

``app_from_env`` is the same app built from the ``LIGHTQ_*`` environment:
uvicorn's factory in each process of ``--producers N`` (``producer.main``).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI

from producer.api import routes_lora, routes_native, routes_openai, routes_requests
from producer.api.errors import install_handlers
from producer.batches import routes as routes_batches
from producer.deps import Services, batch_client
from producer.edge import front_door
from producer.edge.auth import authenticate, key_hashes, key_tenants
from producer.edge.backlog import Gate
from producer.edge.body_limit import BodyLimit
from producer.monitoring import dashboard
from producer.monitoring.client_latency import ClientLatency
from producer.monitoring.cluster_view import ClusterView
from producer.monitoring.metrics import ProducerMetrics
from producer.redis_client import producer_client, trim_idle_forever
from producer.streams.stream_hub import StreamHub
from shared.flags import build
from shared.keys import Keys
from shared.model_files import load_tokenizer, resolve, served_name
from shared.producer_settings import ProducerSettings
from shared.service import default_id, setup_logging

# Set by producer.main for --producers N (prometheus_client reads the same variable at import
# to put every counter and histogram in files shared by the N processes).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PARENT_ENV = "LIGHTQ_PRODUCER_SUPERVISOR_PID"  # set by producer.main: the children's supervisor
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def create_app(settings: ProducerSettings, tokenizer: Any = None) -> FastAPI:
    """The app; its lifespan opens Redis and loads the tokenizer unless one is given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok = tokenizer
        if tok is None:
            tok = await asyncio.to_thread(
                load_tokenizer, resolve(settings.model.model_dir), settings.model.weights_cache
            )
        redis = producer_client(settings)
        keys = settings.redis.keys
        metrics: ProducerMetrics = app.state.metrics
        # The wake stream's name: this process's, unique past a restart (a pid can come back).
        wake_id = f"{default_id('')}-{secrets.token_hex(4)}"
        hub = StreamHub(redis, keys, settings.stream_block_ms, ClientLatency(metrics), wake_id)
        batches = batch_client(settings.redis)
        app.state.services = _services(settings, keys, redis, hub, tok, metrics, batches)
        # The cluster view is read on a thread of its own; /metrics serves the last read.
        app.state.cluster_view = view = ClusterView(
            metrics, lambda: producer_client(settings), keys, settings.metrics_refresh_s
        )
        view.start()
        trimming = asyncio.create_task(trim_idle_forever(redis))  # a burst's connections do not stay
        try:
            yield
        finally:
            trimming.cancel()
            await asyncio.to_thread(view.stop)
            await hub.close()
            await redis.aclose()
            if batches is not None:
                await batches.aclose()

    # authenticate runs before every route (those added later too); it lets OPEN_PATHS through.
    app = FastAPI(title="lightq producer", lifespan=lifespan, dependencies=[Depends(authenticate)])
    _install_edge(app, settings)
    _include_routers(app)
    return app


def _services(
    settings: ProducerSettings,
    keys: Keys,
    redis: aioredis.Redis,
    hub: StreamHub,
    tokenizer: Any,
    metrics: ProducerMetrics,
    batches: aioredis.Redis | None,
) -> Services:
    """What every request shares, over the connections the lifespan opened."""
    return Services(
        settings=settings,
        keys=keys,
        hub=hub,
        redis=redis,
        tokenizer=tokenizer,
        metrics=metrics,
        model_id=served_name(settings.model.model_dir, settings.model.served_model_name),
        # a request's writes get a command's timeout and one retry's, on one server or a cluster
        gate=Gate(
            redis,
            keys,
            settings.max_queue_tokens,
            settings.reject_without_workers,
            deadline_s=2 * settings.redis_timeout_s,
        ),
        api_key_hashes=key_hashes(settings.api_keys, settings.admin_api_keys),
        key_tenants=key_tenants(settings.api_keys, settings.admin_api_keys),
        batch_redis=batches,
    )


def _install_edge(app: FastAPI, settings: ProducerSettings) -> None:
    """The middleware, the metrics and the error handlers, in the order they must be added."""
    app.add_middleware(
        BodyLimit, max_bytes=settings.max_body_bytes, larger={"/v1/batches": settings.max_batch_body_bytes}
    )
    front_door.install(app, settings)  # API keys on every path, JSON-only POST bodies, CORS
    # Before the lifespan: error handlers count rejections.
    app.state.metrics = ProducerMetrics(os.environ.get(MULTIPROC_ENV) or None, settings.metrics_tenants)
    install_handlers(app)


def _include_routers(app: FastAPI) -> None:
    """Every route the producer serves."""
    app.include_router(routes_native.router)
    app.include_router(routes_requests.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_lora.router)
    app.include_router(dashboard.router)
    app.include_router(routes_batches.router)


def app_from_env() -> FastAPI:
    """uvicorn's app factory in each ``--producers`` process: the settings the parent put in the
    environment (``LIGHTQ_*``), as ``lightq producer`` builds them from flags and environment."""
    setup_logging()
    die_with_parent()
    return create_app(build(ProducerSettings, {}))


def die_with_parent() -> None:
    """SIGTERM this process (a graceful stop) when its supervisor dies, even by SIGKILL: an
    orphaned child would keep serving the port, and a producer started again could not bind it.
    Linux only (prctl); the check after it covers a supervisor that died before the call."""
    supervisor = os.environ.get(PARENT_ENV)
    if supervisor is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(supervisor):
        os.kill(os.getpid(), signal.SIGTERM)
