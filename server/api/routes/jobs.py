"""GET /v1/jobs/{id}, GET /v1/jobs/{id}/events, POST /v1/jobs/{id}/cancel."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from server.api.api_docs import ERRORS
from server.api.deps import ApiKey, RuntimeDep, TenantKey
from server.api.job_schemas import JobEvents, JobOut
from server.jobs.model import Job
from server.tenancy import tenants

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[ApiKey])


def job_out(job: Job) -> JobOut:
    return JobOut(**job.to_public())


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS["lookup"])
async def get_job(job_id: str, rt: RuntimeDep) -> JobOut:
    return job_out(await asyncio.to_thread(rt.registration.job, job_id, tenants.current()))


@router.get("/{job_id}/events", response_model=JobEvents, responses=ERRORS["lookup"])
async def job_events(job_id: str, rt: RuntimeDep) -> JobEvents:
    job = await asyncio.to_thread(rt.registration.job, job_id, tenants.current())
    return JobEvents(data=job.events)  # type: ignore[arg-type]


@router.post("/{job_id}/cancel", response_model=JobOut, dependencies=[TenantKey], responses=ERRORS["cancel"])
async def cancel_job(job_id: str, rt: RuntimeDep) -> JobOut:
    return job_out(await asyncio.to_thread(rt.registration.cancel, job_id, tenants.current()))
