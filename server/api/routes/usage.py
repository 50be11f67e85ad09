"""GET /v1/usage?window=SECONDS: tokens and requests by tenant and task (an admin: every tenant;
a tenant key: its own rows only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel

from server.api.api_docs import ERRORS
from server.api.deps import RuntimeDep, TenantKey
from server.api.errors import ApiError
from server.tenancy import tenants


class UsageRow(BaseModel):
    tenant: str
    task: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    refused: int


class UsageList(BaseModel):
    data: list[UsageRow]


DEFAULT_WINDOW = 3600
router = APIRouter(prefix="/v1", tags=["usage"], dependencies=[TenantKey])


@router.get("/usage", response_model=UsageList, responses=ERRORS["usage"])
async def usage(request: Request, rt: RuntimeDep, window: Annotated[int, Query(
        ge=1, description="seconds back from now (at most POLYSERVE_USAGE_WINDOW_MAX_SECONDS, stated as the "
        "maximum; default: an hour, or all that is kept if that is less)")] = DEFAULT_WINDOW) -> UsageList:
    """Counts over the last `window` seconds, in whole minutes. Refusals count 429s at submit. An
    admin key reads every tenant's rows, a tenant key only its own."""
    caller = tenants.current()
    limit = rt.settings.usage_window_max_seconds
    if "window" not in request.query_params:  # the default, lowered to what is kept
        window = min(DEFAULT_WINDOW, limit)
    if window > limit:
        raise ApiError(422, "validation_error", f"window: at most {limit} seconds are kept", param="window")
    rows = rt.usage.rows(window)
    if not caller.admin:  # a tenant reads its own rows (with only API keys nobody is an admin)
        rows = [row for row in rows if row["tenant"] == caller.name]
    return UsageList(data=[UsageRow(**row) for row in rows])  # type: ignore[arg-type]
