"""The worker's HTTP face: /health (liveness), /ready (backbone and inventory loaded, claiming),
/metrics (Prometheus). Nothing else: a worker serves no generations."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from operator import methodcaller

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.fleet.worker.loop import Worker, build_worker
from server.fleet.worker.metrics import WorkerMetrics
from server.infra import access_log
from server.wiring.settings import Settings
from server.wiring.startup import built_in_background, init_state

log = logging.getLogger("polyserve.worker")


def _unavailable(message: str, retry: bool) -> JSONResponse:
    headers = {"Retry-After": "5"} if retry else None
    return JSONResponse({"error": {"type": "unavailable", "message": message}}, status_code=503, headers=headers)


def create_worker_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = WorkerMetrics()
    access_log.install()  # /health and /ready polls at DEBUG

    async def build() -> Worker:
        worker = await asyncio.to_thread(build_worker, settings, metrics)
        worker.start()  # on the event loop's thread, as before it serves
        return worker

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with built_in_background(app, "worker", build, methodcaller("stop"), log):
            yield

    app = FastAPI(title="polyserve worker", version="0.1.0", lifespan=lifespan)
    init_state(app, "worker")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        worker = app.state.worker
        if worker is not None:
            return JSONResponse({"status": "ready", "worker": worker.id, "backbone": worker.backbone.name,
                                 "inventory": worker.model.info.version})
        if app.state.load_error is not None:
            return _unavailable(f"start-up failed ({app.state.load_error}); details in the worker log", False)
        return _unavailable("loading the backbone", True)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
