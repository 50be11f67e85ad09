"""Dependencies, declared once as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from server.api.errors import ApiError
from server.infra.metrics import Metrics
from server.tenancy.tenants import ANONYMOUS, DEFAULT, Directory, Tenant, set_current
from server.tenancy.tenants import current as current_tenant
from server.wiring.runtime import Runtime
from server.wiring.settings import Settings


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
                    description="POLYSERVE_API_KEYS (a tenant: inference, its own tasks, jobs and usage) or "
                                "POLYSERVE_ADMIN_KEYS (everything)")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


def get_tenants(request: Request) -> Directory:
    directory = getattr(request.app.state, "tenants", None)
    if directory is None:  # an app built before tenants existed in its state (tests build apps freely)
        settings = request.app.state.settings
        directory = request.app.state.tenants = Directory(settings.api_keys, settings.admin_keys)
    return directory


def _identify(request: Request, tenant: Tenant) -> None:
    set_current(tenant)
    request.state.tenant = tenant.name  # the metrics middleware labels requests_total with it


def _token(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or not creds.credentials.strip():
        raise ApiError(401, "unauthorized", "missing bearer API key", {"WWW-Authenticate": "Bearer"})
    return creds.credentials.strip()


def _open_caller(directory: Directory, creds: HTTPAuthorizationCredentials | None) -> Tenant:
    """An open route's caller: the tenant of a valid key if one was sent, else anonymous (admin
    only when no key is configured at all: then nothing is anyone's)."""
    token = creds.credentials.strip() if creds is not None else ""
    tenant = directory.lookup(token) if token else None
    return tenant or (ANONYMOUS if not directory.configured else Tenant(DEFAULT))


# async: the tenant is set in the request's own task (server.tenancy.tenants.current), which a sync
# dependency, run in a worker thread, could not do
async def require_api_key(request: Request, settings: SettingsDep, creds: BearerDep) -> None:
    """Inference and read routes: with POLYSERVE_API_KEYS set they need `Authorization: Bearer
    <key>` with one of the API keys or one of the admin keys. Sets the caller's tenant."""
    directory = get_tenants(request)
    if not directory.has_api_keys:
        _identify(request, _open_caller(directory, creds))
        return
    tenant = directory.lookup(_token(creds))
    if tenant is None:
        raise ApiError(401, "unauthorized", "invalid API key", {"WWW-Authenticate": "Bearer"})
    _identify(request, tenant)


async def require_tenant_key(request: Request, settings: SettingsDep, creds: BearerDep) -> None:
    """Task and job changes (POST/DELETE /v1/tasks, job cancel) and GET /v1/usage: with any key
    configured, a valid key of either kind (a tenant acts on what it owns, an admin on
    everything: the routes and server.registry.ownership decide); open when no key is set. With only
    POLYSERVE_ADMIN_KEYS set, that means an admin key (no tenant key exists). Sets the caller's tenant."""
    directory = get_tenants(request)
    if not directory.configured:
        _identify(request, ANONYMOUS)
        return
    tenant = directory.lookup(_token(creds))
    if tenant is None:
        raise ApiError(401, "unauthorized", "invalid API key", {"WWW-Authenticate": "Bearer"})
    _identify(request, tenant)


def require_admin(request: Request, what: str, *, param: str | None = None, strict: bool = False) -> None:
    """403 unless the caller (set by an auth dependency) is an admin. Not strict: only while
    POLYSERVE_ADMIN_KEYS is set (with only API keys, tenants keep what they could do before
    admin keys existed). Strict: always (nobody is an admin with only API keys)."""
    tenant = current_tenant()
    if tenant.admin or (not strict and not get_tenants(request).has_admin_keys):
        return
    raise ApiError(403, "forbidden", f"{what} needs an admin key (POLYSERVE_ADMIN_KEYS)", param=param)


ApiKey = Depends(require_api_key)
TenantKey = Depends(require_tenant_key)
