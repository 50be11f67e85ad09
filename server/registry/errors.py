"""What registration and task resolution refuse, as domain errors: raised where the reason is
known (the registry, the jobs service), mapped to HTTP statuses once, in server/api/errors.py.
The store's own errors (TaskNotFound, TaskExists, TaskLimit, StoreUnavailable...) live in
adapters_store/store/errors.py and are mapped there too."""

from __future__ import annotations


class RegistryError(Exception):
    """A request the registry refuses. `retry_after`: seconds after which trying again may pass."""

    retry_after: int | None = None


class TaskNotReady(RegistryError):
    """The task exists but cannot be served now (training, failed, or trained on another
    inventory)."""

    def __init__(self, task: str, status: str, job_id: str | None = None) -> None:
        job = f"; job {job_id}" if job_id else ""
        super().__init__(f"task {task!r} is not ready (status {status!r}{job})")
        self.task, self.status, self.job_id = task, status, job_id


class TaskForbidden(RegistryError):
    """The caller may see the task but not change it (a shared task and no admin key)."""


class JobsBusy(RegistryError):
    """As many registration jobs are waiting as the server allows (POLYSERVE_MAX_QUEUED_JOBS)."""

    retry_after = 30


class TenantJobLimit(RegistryError):
    """The tenant already has its limit of unfinished jobs (POLYSERVE_TENANT_MAX_JOBS)."""

    retry_after = 30


class TenantTaskLimit(RegistryError):
    """The tenant already owns its limit of tasks (POLYSERVE_TENANT_MAX_TASKS)."""
