"""Liveness and readiness (open, no API key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.api.errors import error_response
from server.api.schemas import ErrorResponse

router = APIRouter(tags=["health"])


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/ready", responses={
    200: {"description": "Loaded and warmed up: backbone name and inventory version"},
    503: {"model": ErrorResponse, "description": "Loading (with Retry-After), or start-up failed"}})
async def ready(request: Request) -> JSONResponse:
    state = request.app.state
    if state.runtime is not None:
        rt = state.runtime
        return JSONResponse({"status": "ready", "backbone": rt.backbone.name,
                             "inventory": rt.registry.inventory_version})
    if state.load_error is not None:
        return error_response(503, "unavailable", f"start-up failed ({state.load_error}); details in the server log")
    return error_response(503, "unavailable", "loading the backbone", {"Retry-After": "5"})
