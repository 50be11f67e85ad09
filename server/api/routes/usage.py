"""GET /v1/usage?window=SECONDS (admin keys only): tokens and requests by tenant and task."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from server import tenants
from server.api.api_docs import ERRORS
from server.api.deps import AdminKey, RuntimeDep
from server.api.errors import ApiError


class UsageRow(BaseModel):
    tenant: str
    task: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    refused: int


class UsageList(BaseModel):
    data: list[UsageRow]


router = APIRouter(prefix="/v1", tags=["usage"], dependencies=[AdminKey])


@router.get("/usage", response_model=UsageList, responses=ERRORS["usage"])
async def usage(rt: RuntimeDep, window: Annotated[int, Query(ge=1, description="seconds back from now "
                                                             "(at most POLYSERVE_USAGE_WINDOW_MAX_SECONDS)")] = 3600
                ) -> UsageList:
    """Counts over the last `window` seconds, in whole minutes. Refusals count 429s at submit."""
    if not tenants.current().admin:  # with only API keys configured nobody is an admin
        raise ApiError(403, "forbidden", "GET /v1/usage needs an admin key (POLYSERVE_ADMIN_KEYS)")
    limit = rt.settings.usage_window_max_seconds
    if window > limit:
        raise ApiError(422, "validation_error", f"window: at most {limit} seconds are kept", param="window")
    return UsageList(data=[UsageRow(**row) for row in rt.usage.rows(window)])  # type: ignore[arg-type]
