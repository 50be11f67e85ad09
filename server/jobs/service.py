"""Task registration over HTTP: glue between the routes, the job runner, the engine loop, the
task registry, and the other replicas. No math here.

    POST /v1/tasks  -> validate -> runner.submit (job + "training" entry persisted) ->
                       engine.add_background_task(runner.step): one adaptation step per engine step
    job done        -> weights committed to the store -> registry.forget + publish to replicas
    DELETE task     -> store.delete_task -> L1 + L2 entries dropped -> publish
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Protocol

from adapters_store.lora.inject import RoutedModel
from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import JobNotFound, TaskExists, TaskLimit, TaskNotFound
from adapters_store.store.ids import validate_new_task_id
from adapters_store.store.records import TaskRecord
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.l2 import RedisTier
from server.engines.base import Engine
from server.fleet.replicas import ReplicaSync
from server.infra.metrics import Metrics
from server.jobs.model import Job
from server.jobs.runner import JobRunner
from server.registry.errors import JobsBusy, TaskForbidden, TenantJobLimit, TenantTaskLimit
from server.registry.ownership import can_change, can_see, can_see_job, owner_of_new_task
from server.registry.tasks import TaskRegistry
from server.tenancy.tenants import ANONYMOUS, Directory, Tenant, weighted_share
from server.wiring.settings import Settings

log = logging.getLogger(__name__)


def _quota_bound(tenant: Tenant | None) -> bool:
    """Quotas bind tenants; admins (the operators) and key-less servers (one caller) are exempt."""
    return tenant is not None and tenant is not ANONYMOUS and not tenant.admin


def job_quota(settings: Settings, weights: dict[str, float], tenant: Tenant | None) -> int | None:
    """Jobs queued or running `tenant` may have: POLYSERVE_TENANT_MAX_JOBS, by default its weighted
    share of POLYSERVE_MAX_QUEUED_JOBS (so one tenant cannot fill the queue); None: no quota."""
    if tenant is None or not _quota_bound(tenant):
        return None
    if settings.tenant_max_jobs is not None:
        return settings.tenant_max_jobs
    return weighted_share(settings.max_queued_jobs, weights, tenant.name)


def task_quota(settings: Settings, weights: dict[str, float], tenant: Tenant | None) -> int | None:
    """Tasks `tenant` may own: POLYSERVE_TENANT_MAX_TASKS, by default its weighted share of
    POLYSERVE_MAX_TASKS; None: no quota (an exempt caller, or neither setting)."""
    if tenant is None or not _quota_bound(tenant):
        return None
    if settings.tenant_max_tasks is not None:
        return settings.tenant_max_tasks
    if settings.max_tasks is None:
        return None
    return weighted_share(settings.max_tasks, weights, tenant.name)


class Served(Protocol):
    """What registration asks of the runtime that builds it (server/wiring/runtime.py's Runtime)."""

    @property
    def settings(self) -> Settings: ...
    @property
    def store(self) -> AdapterStore: ...
    @property
    def routed(self) -> RoutedModel | None: ...
    @property
    def cache(self) -> AdapterCache | None: ...
    @property
    def l2(self) -> RedisTier | None: ...
    @property
    def registry(self) -> TaskRegistry: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def tokenizer(self) -> Any: ...


class Registration:
    def __init__(self, rt: Served, *, rescan_every: float = 1.0) -> None:
        self.rt = rt
        self.replica_id = f"replica-{secrets.token_hex(4)}"
        self.runner = JobRunner(rt.store, self._make_adaptation, replica_id=self.replica_id,
                                on_task_changed=self._changed_here, on_job_finished=self._finished,
                                run_here=rt.settings.jobs == "local")
        self.sync = ReplicaSync(rt.settings.redis_url, self._changed_elsewhere, replica_id=self.replica_id,
                                rescan_every=rescan_every, on_redis_error=rt.metrics.redis_errors.inc)
        self._submit_lock = threading.Lock()
        self._versions: dict[str, Any] = {}
        self._cursor: int | None = None  # the store's change cursor at the last re-scan
        self._quiet = 0  # re-scans in a row that found the cursor where it was
        self._unsubscribe: Any = None
        directory = Directory(rt.settings.api_keys, rt.settings.admin_keys)
        self._weights, self._admins_exist = directory.weights, directory.has_admin_keys

    def start(self) -> list[str]:
        self.prune()
        recovered = self.runner.recover()
        for task in recovered:
            log.warning("job of task %r was interrupted by a restart; marked failed", task)
        self._versions = self._snapshot()
        self.sync.start()
        self._unsubscribe = self.rt.store.subscribe(self._changed_elsewhere)  # PostgreSQL: LISTEN
        return recovered

    def close(self) -> None:
        self.sync.stop()
        if self._unsubscribe is not None:
            self._unsubscribe()

    def prune(self) -> int:
        """Forget finished jobs older than the retention (at start and before each new job)."""
        cutoff = time.time() - self.rt.settings.job_retention_seconds
        self.runner.forget_finished(cutoff)
        removed = self.rt.store.prune_jobs(cutoff)
        if removed:
            log.info("pruned %d finished jobs older than the retention", removed)
        self.rt.store.sweep_task_locks()
        return removed

    # -- HTTP-facing ----------------------------------------------------------------------------
    def submit(self, task: str, examples: list[dict[str, str]], method: str, steps: int | None,
               seed: int | None, *, serve_early: bool = False, tenant: Tenant | None = None,
               shared: bool = False, description: str | None = None) -> Job:
        """Raises ValueError (bad / reserved id), TaskExists (409), RuntimeError (no inventory),
        JobsBusy (POLYSERVE_MAX_QUEUED_JOBS unfinished here), TenantJobLimit (the tenant's own
        jobs), TaskLimit (POLYSERVE_MAX_TASKS) or TenantTaskLimit (the tasks it owns); the limits
        are checked and the job queued under one lock, so a burst of POSTs cannot pass them together
        (in this process: replicas submitting at the same moment may each pass a limit once, as for
        the global ones)."""
        validate_new_task_id(task)
        self.prune()
        if self.rt.routed is None:
            raise RuntimeError("this server has no skill inventory: only `base` is servable, nothing to adapt")
        # two concurrent POSTs of one id, in this process or in another replica: one wins
        settings = self.rt.settings
        with self._submit_lock:
            # JOBS=local: this replica's own jobs; off: the fleet's queue, the workers' backlog
            here = self.runner.run_here
            pending = self.runner.pending if here else self.rt.store.queued_jobs()
            if pending >= settings.max_queued_jobs:
                where = "queued or running here" if here else "waiting in the fleet's queue for its workers"
                raise JobsBusy(f"{settings.max_queued_jobs} registration jobs are already {where}; retry later")
            quota = self.tenant_job_limit(tenant)
            if quota is not None and tenant is not None:
                mine = self.runner.pending_of(tenant.name) if here else self.rt.store.queued_jobs(tenant.name)
                if mine >= quota:
                    self._refused(tenant, "jobs")
                    raise TenantJobLimit(f"tenant {tenant.name!r} already has {mine} registration jobs queued or "
                                         f"running, its limit (POLYSERVE_TENANT_MAX_JOBS: {quota}); retry when "
                                         "one finishes")
            with self.rt.store.task_lock(task):
                job = self._submit_locked(task, examples, method, steps, seed, serve_early, tenant, shared,
                                          description)
        if self.runner.run_here:  # POLYSERVE_JOBS=off: a worker claims it from the store's queue
            self.rt.engine.add_background_task(self.runner.step)
        return job

    def _submit_locked(self, task: str, examples: list[dict[str, str]], method: str, steps: int | None,
                       seed: int | None, serve_early: bool, tenant: Tenant | None, shared: bool,
                       description: str | None = None) -> Job:
        exists = self.rt.store.has_task(task)
        if exists:
            record = self.rt.store.get_task(task)
            if record.status != "failed":
                suffix = f" (job {record.job_id})" if record.status == "training" else ""
                raise TaskExists(f"task {task!r} already exists with status {record.status!r}{suffix}")
            if not self._may_change(record, tenant):
                # someone else's failed task: the id is taken, and what it holds is not the caller's
                raise TaskExists(f"task id {task!r} is taken")
        limit = self.rt.settings.max_tasks
        if not exists and limit is not None and len(self.rt.store.task_stamps()) >= limit:
            raise TaskLimit(f"this store already holds {limit} tasks (POLYSERVE_MAX_TASKS); delete one first")
        if not exists:
            self.check_task_quota(tenant)
        return self.runner.submit(task, examples, method=method, steps=steps, seed=seed,
                                  serve_early=serve_early and method != "retrieve",
                                  tenant=owner_of_new_task(tenant), shared=shared, description=description)

    # -- per-tenant quotas -------------------------------------------------------------------------
    def tenant_job_limit(self, tenant: Tenant | None) -> int | None:
        return job_quota(self.rt.settings, self._weights, tenant)

    def tenant_task_limit(self, tenant: Tenant | None) -> int | None:
        return task_quota(self.rt.settings, self._weights, tenant)

    def check_task_quota(self, tenant: Tenant | None) -> None:
        """TenantTaskLimit when `tenant` already owns its limit of tasks (registration and
        LoRA import). Counted in the registry's snapshot (current, and no record read when
        nothing changed: adapters_store/store/snapshot.py); only for a quota-bound caller's new task."""
        quota = self.tenant_task_limit(tenant)
        if quota is None or tenant is None:
            return
        owned = sum(1 for record in self.rt.registry.list() if record.owner == tenant.name)
        if owned >= quota:
            self._refused(tenant, "tasks")
            raise TenantTaskLimit(f"tenant {tenant.name!r} already owns {owned} tasks, its limit "
                                  f"(POLYSERVE_TENANT_MAX_TASKS: {quota}); delete one first")

    def _may_change(self, record: TaskRecord, tenant: Tenant | None) -> bool:
        return can_change(record, tenant, isolated=self.rt.registry.isolated, admins_exist=self._admins_exist)

    def _refused(self, tenant: Tenant, limit: str) -> None:
        self.rt.metrics.tenant_refused.labels(tenant=tenant.name, limit=limit).inc()

    def delete(self, task: str, tenant: Tenant | None = None) -> None:
        """Works from any replica: a job training the task (here or elsewhere) is cancelled and
        its commit, which checks under the same task lock, finds the task gone. TaskNotFound
        also when `tenant` may not see the task (and for a task that does not exist, before any
        lock file is made for its id)."""
        if not self.rt.store.has_task(task):
            raise TaskNotFound(task)
        with self.rt.store.task_lock(task):
            record = self.rt.store.get_task(task)
            if tenant is not None and not can_see(record, tenant, isolated=self.rt.registry.isolated):
                raise TaskNotFound(task)  # someone else's task: as if it did not exist
            if not self._may_change(record, tenant):
                raise TaskForbidden(f"task {task!r} is shared: only an admin key (POLYSERVE_ADMIN_KEYS) may delete it")
            if record.job_id and (record.status == "training" or self._unfinished(record.job_id)):
                self.cancel(record.job_id)  # serve_early: the task is ready while its job still trains
            cache = self.rt.cache
            key = cache.key(record) if cache is not None and record.status == "ready" else None
            try:
                self.rt.store.delete_task(task)
            except TaskNotFound:
                pass  # the cancelled job removed its own placeholder meanwhile (here, or on its replica)
        if key is not None and self.rt.l2 is not None:
            self.rt.l2.delete(key)
        self.rt.store.sweep_task_locks()
        self._changed_here(task)

    # -- the adaptation a job runs ------------------------------------------------------------------
    def _make_adaptation(self, job: Job, examples: list[dict[str, str]], progress):
        """server.jobs.adaptation says what each method runs."""
        from server.jobs.adaptation import TrainingModel, make_adaptation

        rt = self.rt
        if rt.routed is None or rt.cache is None:
            raise RuntimeError("no skill inventory loaded")
        model = TrainingModel(rt.routed, rt.cache.info, rt.cache.skills, rt.tokenizer, rt.store,
                              rt.settings.demonstration_budget)
        return make_adaptation(model, job, examples, progress, lambda res: self.runner.commit_early(job, res))

    def _unfinished(self, job_id: str) -> bool:
        try:
            return not self.runner.get(job_id).finished
        except Exception:  # noqa: BLE001 - pruned or unreadable: nothing left to cancel
            return False

    # -- change propagation -----------------------------------------------------------------------
    def _forget(self, task: str) -> None:
        """Drop everything cached for a changed task: adapters (L1) and the engine's state."""
        self.rt.registry.forget(task)
        self.rt.engine.forget(task)

    def _changed_here(self, task: str) -> None:
        self._forget(task)
        self._versions = self._snapshot()
        self.sync.publish(task)

    def _changed_elsewhere(self, task: str | None) -> None:
        """A notification from another replica (task) or the periodic re-scan (None)."""
        if task is not None:
            self._forget(task)
            return
        cursor = self.rt.store.change_cursor()
        if cursor is not None:  # one O(1) read instead of every task's stamp
            if cursor != self._cursor:
                self._cursor, self._quiet = cursor, 0
            else:
                self._quiet += 1
                # a write takes its number before it commits: compare the stamps once more after
                # the cursor stops moving, then rest until it moves again
                if self._quiet >= 2:
                    return
        now = self._snapshot()
        for changed in {t for t in now.keys() | self._versions.keys() if now.get(t) != self._versions.get(t)}:
            self._forget(changed)
        self._versions = now

    def _snapshot(self) -> dict[str, Any]:
        """Stamps only (no record is read): the re-scan runs every second whatever the task count."""
        return self.rt.store.task_stamps()

    def _finished(self, job: Job) -> None:
        metrics = self.rt.metrics
        metrics.jobs.labels(status=job.status).inc()
        if job.started_at and job.finished_at and job.status == "succeeded":
            metrics.adaptation_seconds.observe(job.finished_at - job.started_at)

    # -- reads ------------------------------------------------------------------------------------
    def job(self, job_id: str, tenant: Tenant | None = None) -> Job:
        """JobNotFound also when `tenant` may not see it (its task's owner and admins may)."""
        job = self.runner.get(job_id)
        if tenant is not None and not can_see_job(job.tenant, tenant, isolated=self.rt.registry.isolated):
            raise JobNotFound(job_id)
        return job

    def cancel(self, job_id: str, tenant: Tenant | None = None) -> Job:
        """This replica's job: cancelled at once (queued) or at its next slice (running). A job in
        the fleet's queue that no worker has claimed: cancelled at once, here. Another replica's or
        worker's unfinished job: a cancel marker in the store, which its runner checks every slice."""
        self.job(job_id, tenant)  # JobNotFound: unknown, or not the caller's
        if self.runner.owns(job_id):
            return self.runner.cancel(job_id)
        job = self.runner.get(job_id)  # JobNotFound -> 404
        if not job.finished and self.rt.store.job_enqueued(job_id):
            cancelled = self.runner.cancel_unclaimed(job_id, self.rt.settings.job_lease_seconds)
            if cancelled is not None:
                return cancelled
            job = self.runner.get(job_id)
        if not job.finished:
            self.rt.store.request_cancel(job_id)
            job.add_event("status", "cancellation requested")
        return job

