"""Dependencies, declared once as Annotated aliases."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

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


bearer = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="POLYSERVE_API_KEYS (inference) or POLYSERVE_ADMIN_KEYS (everything)")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


def _matches(token: str, keys: list[str]) -> bool:
    supplied, ok = token.encode(), False
    for key in keys:  # constant-time compare against every key
        ok |= hmac.compare_digest(supplied, key.encode())
    return ok


def _token(request: Request, creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or not creds.credentials.strip():
        raise ApiError(401, "unauthorized", "missing bearer API key", {"WWW-Authenticate": "Bearer"})
    return creds.credentials.strip()


def require_api_key(request: Request, settings: SettingsDep, creds: BearerDep) -> None:
    """Inference and read routes: with POLYSERVE_API_KEYS set they need `Authorization: Bearer
    <key>` with one of the API keys or one of the admin keys."""
    if not settings.api_keys:
        return
    if not _matches(_token(request, creds), [*settings.api_keys, *settings.admin_keys]):
        raise ApiError(401, "unauthorized", "invalid API key", {"WWW-Authenticate": "Bearer"})


def require_admin_key(request: Request, settings: SettingsDep, creds: BearerDep) -> None:
    """Task and job mutation (POST/DELETE /v1/tasks, job cancel): with POLYSERVE_ADMIN_KEYS set only
    an admin key (an API key answers 403); with only POLYSERVE_API_KEYS set any API key; open
    when neither is set."""
    keys = settings.admin_keys or settings.api_keys
    if not keys:
        return
    token = _token(request, creds)
    if _matches(token, keys):
        return
    if settings.admin_keys and _matches(token, settings.api_keys):
        raise ApiError(403, "forbidden", "this API key may not change tasks or jobs (needs an admin key)")
    raise ApiError(401, "unauthorized", "invalid API key", {"WWW-Authenticate": "Bearer"})


ApiKey = Depends(require_api_key)
AdminKey = Depends(require_admin_key)
