"""GET /v1/tasks/{task}/similar?k=5: the tasks nearest to a task by routing row
(server/registry/similar_index.py; the score is adapters_store.lora.similar's centred cosine)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import BaseModel

from adapters_store.store.errors import TaskNotFound
from adapters_store.store.ids import validate_task_id
from server.api.api_docs import ERRORS
from server.api.deps import ApiKey, RuntimeDep
from server.api.errors import ApiError
from server.registry.ownership import can_see
from server.registry.similar_index import NotRouted
from server.tenancy import tenants

router = APIRouter(prefix="/v1", tags=["tasks"], dependencies=[ApiKey])

MAX_K = 100


class SimilarTask(BaseModel):
    id: str
    score: float  # cosine of the routing rows' deviations from the uniform routing, in [-1, 1]


class SimilarList(BaseModel):
    data: list[SimilarTask]


@router.get("/tasks/{task}/similar", response_model=SimilarList,
            responses={**ERRORS["lookup"], 409: ERRORS["register"][409], 422: ERRORS["register"][422]})
async def similar_tasks(task: str, rt: RuntimeDep,
                        k: Annotated[int, Query(ge=1, le=MAX_K, description="how many tasks")] = 5) -> SimilarList:
    """The k routed tasks whose routing rows are nearest to this task's, best first."""
    try:
        validate_task_id(task)
    except ValueError as err:
        raise ApiError(404, "not_found", f"task: {err}") from None
    index = rt.registry.routing_index
    if index is None:
        raise ApiError(409, "conflict", "no skill inventory is loaded: tasks have no routing rows")
    tenant = tenants.current()

    def find() -> list[tuple[str, float]]:
        rt.registry.get(task, tenant)  # someone else's task is not found
        if not rt.registry.isolated or tenant is None or tenant.admin:
            return index.similar(task, k)
        return index.similar(task, k, visible=lambda record: can_see(record, tenant, isolated=True))

    try:
        found = await asyncio.to_thread(find)
    except TaskNotFound:
        raise ApiError(404, "not_found", f"task {task!r} not found", param="task") from None
    except NotRouted as err:
        raise ApiError(409, "conflict", str(err), param="task") from None
    return SimilarList(data=[SimilarTask(id=t, score=round(s, 6)) for t, s in found])
