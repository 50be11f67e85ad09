"""Dependencies, declared once as Annotated aliases."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from server.errors import ApiError
from server.metrics import Metrics
from server.runtime import Runtime
from server.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_runtime(request: Request) -> Runtime:
    rt = request.app.state.runtime
    if rt is None:
        raise ApiError(503, "unavailable", "server is starting: backbone not loaded yet", {"Retry-After": "5"})
    return rt


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def require_api_key(request: Request, settings: SettingsDep) -> None:
    """With POLYSERVE_API_KEYS set, /v1/* needs `Authorization: Bearer <key>` (constant-time compare)."""
    if not settings.api_keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise ApiError(401, "unauthorized", "missing bearer API key", {"WWW-Authenticate": "Bearer"})
    supplied = token.strip().encode()
    ok = False
    for key in settings.api_keys:
        ok |= hmac.compare_digest(supplied, key.encode())
    if not ok:
        raise ApiError(401, "unauthorized", "invalid API key", {"WWW-Authenticate": "Bearer"})


ApiKey = Depends(require_api_key)
