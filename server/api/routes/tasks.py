"""GET /v1/tasks, GET /v1/tasks/{task}, POST /v1/tasks (register from examples), DELETE /v1/tasks/{task}."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from adapters_store.store.ids import RESERVED_TASK_IDS, validate_task_id
from server.api.api_docs import ERRORS
from server.api.deps import ApiKey, RuntimeDep, SettingsDep, TenantKey, require_admin
from server.api.errors import ApiError
from server.api.job_schemas import SERVE_EARLY_METHODS, JobOut, RegisterRequest
from server.api.lora_tasks import import_lora_task
from server.api.routes.jobs import job_out
from server.api.schemas import TaskList, TaskOut, matches, task_out
from server.registry.tasks import BASE
from server.tenancy import tenants

router = APIRouter(prefix="/v1", tags=["tasks"], dependencies=[ApiKey])



def base_out(rt) -> TaskOut:
    return TaskOut(id=BASE, status="ready", method="base", version=0, created_at=rt.started_at,
                   updated_at=rt.started_at, params=0, kind=None)


@router.get("/tasks", response_model=TaskList, responses=ERRORS["search"])
async def list_tasks(rt: RuntimeDep, search: Annotated[str | None, Query(
        max_length=200, description="only the tasks whose id or description holds every word of it (any case)")] = None,
) -> TaskList:
    records = await asyncio.to_thread(rt.registry.list, tenants.current())
    if search is not None and search.strip():
        records = [r for r in records if matches(r, search)]
    return TaskList(data=[task_out(r) for r in records])


@router.get("/tasks/{task}", response_model=TaskOut, responses=ERRORS["lookup"])
async def get_task(task: str, rt: RuntimeDep) -> TaskOut:
    try:
        validate_task_id(task)
    except ValueError as err:
        raise ApiError(404, "not_found", f"task: {err}") from None
    if task == BASE:
        return base_out(rt)
    return task_out(await asyncio.to_thread(rt.registry.get, task, tenants.current()))


@router.post("/tasks", status_code=202, response_model=JobOut, dependencies=[TenantKey],
             responses=ERRORS["register"])
async def register_task(body: RegisterRequest, request: Request, rt: RuntimeDep,
                        settings: SettingsDep) -> JobOut | Response:
    """Register a task from few-shot examples: 202 with the job that learns it, the task owned by
    the caller's tenant. With method `lora`: 201 with the imported task (server.api.lora_tasks;
    an admin key's, once admin keys are set)."""
    if body.shared:  # strict: with only API keys nobody is an admin, so nobody shares
        require_admin(request, "shared: a task every tenant can use", param="shared", strict=True)
    if body.examples is not None and len(body.examples) < settings.min_examples_per_task:
        raise ApiError(422, "validation_error",
                       f"examples: at least {settings.min_examples_per_task} examples per task "
                       f"(POLYSERVE_MIN_EXAMPLES_PER_TASK), got {len(body.examples)}", param="examples")
    if body.method == "lora":
        # arbitrary uploaded weights, up to the body limit: an operator's act once operators exist
        require_admin(request, "method lora (importing a LoRA over HTTP)", param="method")
        return await import_lora_task(body, rt)
    if body.examples is None:
        raise ApiError(422, "validation_error", "examples: Field required", param="examples")
    if len(body.examples) > settings.max_examples_per_task:
        raise ApiError(422, "validation_error",
                       f"examples: at most {settings.max_examples_per_task} examples per task, "
                       f"got {len(body.examples)}",
                       param="examples")
    if body.steps is not None and body.method in ("retrieve", "demos"):
        raise ApiError(422, "validation_error", f"steps: {body.method} takes no optimisation steps", param="steps")
    if body.serve_early and body.method not in SERVE_EARLY_METHODS:
        raise ApiError(422, "validation_error", "serve_early: only with a method that has a form to serve before "
                       f"training ({', '.join(SERVE_EARLY_METHODS)}), not {body.method}", param="serve_early")
    if body.steps is not None and body.steps > settings.max_job_steps:
        raise ApiError(422, "validation_error", f"steps: at most {settings.max_job_steps}, got {body.steps}",
                       param="steps")
    if body.task in RESERVED_TASK_IDS:
        raise ApiError(422, "validation_error", f"task: {body.task!r} is reserved", param="task")
    caller = tenants.current()
    examples = [e.model_dump() for e in body.examples]
    try:
        job = await asyncio.to_thread(rt.registration.submit, body.task, examples, body.method, body.steps, body.seed,
                                      serve_early=body.serve_early, tenant=caller, shared=body.shared,
                                      description=body.description)
    except RuntimeError as err:
        raise ApiError(409, "conflict", str(err)) from None
    return job_out(job)


@router.delete("/tasks/{task}", status_code=204, dependencies=[TenantKey], responses=ERRORS["delete"])
async def delete_task(task: str, rt: RuntimeDep) -> Response:
    try:
        validate_task_id(task)
    except ValueError as err:
        raise ApiError(404, "not_found", f"task: {err}") from None
    if task in RESERVED_TASK_IDS:
        raise ApiError(409, "conflict", f"task {task!r} is the bare backbone and cannot be deleted")
    await asyncio.to_thread(rt.registration.delete, task, tenants.current())
    return Response(status_code=204)
