"""`polyserve store copy`: move a store to another backend (a directory into PostgreSQL, or back),
then read everything back from the destination and compare.

Copied: the inventory (its bytes, so its version stays), every task record as it is (versions,
times, owners, metrics) with the weights it names, and finished jobs with their examples.
Unfinished jobs are left out and counted: their runner is in the source's processes, and a copy of
them would be reported interrupted. The destination must be empty, or hold exactly what is being
copied (a copy run again after an interruption finishes the job); anything else is refused before
a single write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from safetensors.torch import load as st_load

from adapters_store.store.contract import TERMINAL_JOB_STATES, AdapterStore, tensors_digest
from adapters_store.store.errors import StoreError
from adapters_store.store.records import TaskRecord


@dataclass
class CopyReport:
    inventory: str | None = None
    tasks: int = 0
    tasks_already_there: int = 0
    jobs: int = 0
    jobs_left_out: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, object]:
        return {"inventory": self.inventory, "tasks": self.tasks, "tasks_already_there": self.tasks_already_there,
                "jobs": self.jobs, "unfinished_jobs_left_out": self.jobs_left_out}


def _conflicts(src: AdapterStore, dst: AdapterStore, records: list[TaskRecord]) -> list[str]:
    problems = []
    if dst.has_inventory() and src.has_inventory():
        if dst.inventory_info().version != src.inventory_info().version:
            problems.append(f"the destination holds another inventory ({dst.inventory_info().version})")
    elif dst.has_inventory():
        problems.append("the destination holds an inventory and the source none")
    theirs = {r.id: r for r in dst.list_tasks()}
    for record in records:
        if record.id in theirs and theirs[record.id] != record:
            problems.append(f"task {record.id!r} differs in the destination")
    return problems


def copy_store(src: AdapterStore, dst: AdapterStore, *, progress: Callable[[int], None] = lambda n: None) -> CopyReport:
    records = src.list_tasks()
    problems = _conflicts(src, dst, records)
    if problems:
        raise StoreError("refusing to copy into a store that is not empty: " + "; ".join(problems[:5]))
    report = CopyReport()
    existing = {r.id for r in dst.list_tasks()}
    for record in records:
        if record.id in existing:
            report.tasks_already_there += 1
        else:
            blob = src.weights_bytes(record, ready_only=False) if record.file else None
            dst.import_task(record, blob)
            report.tasks += 1
        progress(1)
    for job in src.list_jobs():
        if job.get("status") not in TERMINAL_JOB_STATES:
            report.jobs_left_out.append(job["id"])
            continue
        try:
            dst.put_job_examples(job["id"], src.get_job_examples(job["id"]))
        except StoreError:
            pass  # pruned examples, or a job that never had any
        dst.put_job(job)
        report.jobs += 1
    if src.has_inventory():  # last: a destination with an inventory is a complete copy
        info, skills = src.inventory_bytes()
        dst.import_inventory(info, skills)
        report.inventory = info.version
    verify_copy(src, dst)
    return report


def verify_copy(src: AdapterStore, dst: AdapterStore) -> None:
    """Read the destination back: the same inventory version with skills matching it, every
    source task's record equal and its weights matching its digest, every finished job equal."""
    if src.has_inventory():
        info, _ = dst.inventory_bytes()  # checks the skills against the version
        if info != src.inventory_info():
            raise StoreError("verification failed: the inventory differs after the copy")
    for record in src.list_tasks():
        copied = dst.get_task(record.id)
        if copied != record:
            raise StoreError(f"verification failed: task {record.id!r} differs after the copy")
        if record.file and tensors_digest(st_load(dst.weights_bytes(copied, ready_only=False))) != record.digest:
            raise StoreError(f"verification failed: task {record.id!r}'s weights do not match its digest")
    theirs = {j["id"]: j for j in dst.list_jobs()}
    for job in src.list_jobs():
        if job.get("status") in TERMINAL_JOB_STATES and theirs.get(job["id"]) != job:
            raise StoreError(f"verification failed: job {job['id']} differs after the copy")
