"""Prometheus exposition (open, no API key)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from server.deps import MetricsDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(m: MetricsDep) -> Response:
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
