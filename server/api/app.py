"""The FastAPI app: a thin shell. `create_app(settings)`; the lifespan builds the Runtime
(backbone, store, caches, engine, warm-up) off the event loop, so /health answers at once and
/ready turns 200 when the backbone is loaded and warmed up."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from operator import methodcaller
from typing import Any

from fastapi import FastAPI

from server.api import api_docs
from server.api.errors import install_handlers
from server.api.middleware import BodyLimit, RequestMetrics
from server.api.openai import responses as openai_responses
from server.api.openai import routes as openai
from server.api.openai import tokenize_routes as tokenize
from server.api.routes import generate, health, jobs, metrics, similar, tasks, usage
from server.infra import access_log, cpus, openmp
from server.infra.metrics import Metrics
from server.tenancy.tenants import Directory
from server.wiring.runtime import Runtime
from server.wiring.settings import Settings
from server.wiring.startup import built_in_background, init_state

log = logging.getLogger("polyserve")


def create_app(settings: Settings | None = None, *, backbone: Any = None) -> FastAPI:
    """backbone: an already loaded adapters_store.backbone.load.Backbone (tests), else settings.backbone."""
    settings = settings or Settings()
    metrics_ = Metrics()
    access_log.install()  # /health and /ready polls at DEBUG

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # the engine's thread count: POLYSERVE_THREADS, else one per CPU this process may use
        # (affinity, cpuset, CPU quota: server/infra/cpus.py), never torch's count of the host's cores
        threads = cpus.default_threads(settings.threads)
        # threads of the default executor (adapter resolution, store reads) never start an OpenMP
        # pool: the engine thread's is the only one (server/infra/openmp.py)
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="polyserve-io", initializer=openmp.one_thread))

        async def build() -> Runtime:  # in a thread that ends (its OpenMP pool with it)
            return await asyncio.to_thread(openmp.in_fresh_thread, Runtime.build, settings, metrics_, backbone, threads)

        async with built_in_background(app, "runtime", build, methodcaller("close"), log):
            yield

    app = FastAPI(title="polyserve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics_
    init_state(app, "runtime")
    app.state.tenants = Directory(settings.api_keys, settings.admin_keys)  # names, weights, keys
    install_handlers(app)
    api_docs.install(app, settings)
    if settings.admin_keys and not settings.api_keys:
        log.warning("POLYSERVE_ADMIN_KEYS without POLYSERVE_API_KEYS: inference routes are open")
    for module in (health, metrics, generate, openai, openai_responses, tasks, similar, jobs, usage, tokenize):
        app.include_router(module.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestMetrics, metrics=metrics_)
    return app
