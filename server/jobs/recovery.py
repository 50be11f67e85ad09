"""At start-up (any replica): the jobs whose process died, settled.

The process running a job holds the store's claim on it (server/jobs/leases.py), so a job whose
claim is free while its status is not terminal lost its runner: it succeeded if its result was
committed before (the task record names it, server/jobs/journal.py's commit point), else it
failed with reason "interrupted". A job in the fleet's queue is its workers' (its lease says
whether its runner lives). Runs on the caller's thread (`JobRunner.recover()`,
server/jobs/runner.py), before the runner has jobs of its own to write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from adapters_store.store.contract import AdapterStore
from server.jobs.journal import Journal, committed, mark_task_not_ready
from server.jobs.model import Job
from server.jobs.state import RunnerState

log = logging.getLogger(__name__)


def recover(store: AdapterStore, state: RunnerState, journal: Journal,
            on_task_changed: Callable[[str], None]) -> list[str]:
    """Every unfinished job whose owner process is gone: succeeded if its result was committed
    (the task record names it), else failed ("interrupted"). Returns their ids."""
    recovered = []
    for data in store.list_jobs():
        try:
            job = Job.from_json(data)
        except (TypeError, ValueError):  # a record this version cannot read: never stop a start-up
            log.warning("job record %r skipped: unreadable", data.get("id"))
            continue
        if job.finished or job.id in state.jobs:
            continue
        if store.job_enqueued(job.id):
            continue  # the fleet's workers own it: its lease says whether its runner lives
        hold = store.hold_job(job.id)  # a live owner would hold it
        if hold is None:
            continue  # another live replica runs it
        try:
            job = Job.from_json(store.get_job(job.id))  # it may have finished meanwhile
            if job.finished:
                continue
            if committed(store, job):  # killed after the commit point, before the job said so
                job.transition("succeeded")
                job.add_event("status", "recovered: the result was committed before the server stopped")
                journal.persist(job)
            else:
                reason = "before the job ran" if job.status == "queued" else "while the job was running"
                job.transition("failed", error={"type": "interrupted",
                                                "message": f"interrupted: the server stopped {reason}"})
                journal.persist(job)
                mark_task_not_ready(store, job, "failed", job.error)
        finally:
            hold.release()
        recovered.append(job.id)
        on_task_changed(job.task)
    return recovered
