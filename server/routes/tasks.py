"""GET /v1/tasks, GET /v1/tasks/{task}. (POST/DELETE and jobs: issue #5, same registry.)"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from adapters_store.ids import validate_task_id
from adapters_store.records import TaskRecord
from server.deps import ApiKey, RuntimeDep
from server.errors import ApiError
from server.schemas import TaskList, TaskOut
from server.tasks import BASE

router = APIRouter(prefix="/v1", tags=["tasks"], dependencies=[ApiKey])


def task_out(record: TaskRecord) -> TaskOut:
    return TaskOut(
        id=record.id, status=record.status, method=record.method, version=record.version,
        created_at=record.created_at, updated_at=record.updated_at, params=record.params, kind=record.kind,
        inventory_version=record.inventory_version, job_id=record.job_id, error=record.error,
        metrics=record.metrics,
    )


def base_out(rt) -> TaskOut:
    return TaskOut(id=BASE, status="ready", method="base", version=0, created_at=rt.started_at,
                   updated_at=rt.started_at, params=0, kind=None)


@router.get("/tasks", response_model=TaskList)
async def list_tasks(rt: RuntimeDep) -> TaskList:
    records = await asyncio.to_thread(rt.registry.list)
    return TaskList(data=[task_out(r) for r in records])


@router.get("/tasks/{task}", response_model=TaskOut)
async def get_task(task: str, rt: RuntimeDep) -> TaskOut:
    try:
        validate_task_id(task)
    except ValueError as err:
        raise ApiError(404, "not_found", f"task: {err}") from None
    if task == BASE:
        return base_out(rt)
    return task_out(await asyncio.to_thread(rt.registry.get, task))
