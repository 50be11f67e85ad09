"""The adapter store on disk: one skill inventory, per-task routing rows or LoRAs, a task
registry and job records. safetensors + JSON only (never pickle); every write is atomic.

    <root>/inventory/inventory.json        InventoryInfo
    <root>/inventory/skills.safetensors    "<layer>.A" (h, S, d_in/h, r), "<layer>.B" (h, S, r, d_out/h)
    <root>/tasks/<id>/task.json            TaskRecord (the commit point of a task write)
    <root>/tasks/<id>/routing-<v>.safetensors   "logits" (L, h, S)
    <root>/tasks/<id>/lora-<v>.safetensors      "<layer>.A" (d_in, r), "<layer>.B" (r, d_out)
    <root>/jobs/<id>.json                  job records (owned by the server's job runner)
    <root>/jobs/examples/<id>.json         a job's uploaded examples
    <root>/jobs/locks/<id>.lock            held (fcntl) by the process running the job

A task's weights file is written first, then task.json pointing at it; a crash in between
leaves the previous task.json (and an orphan file that `open` sweeps). Writing one task never
touches another task's files.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from adapters_store.atomic import (
    TMP_PREFIX,
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    sweep_temp_files,
)
from adapters_store.errors import FingerprintMismatch, JobNotFound, StoreError, TaskNotFound
from adapters_store.ids import validate_task_id
from adapters_store.records import InventoryInfo, TaskRecord
from adapters_store.spec import InventorySpec

JOB_ID_RE = re.compile(r"^job-[a-z0-9]{6,40}$")

log = logging.getLogger(__name__)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _same_file(f: Any, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path` (not unlinked or replaced)."""
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class Store:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        for sub in ("inventory", "tasks", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        sweep_temp_files(self.root)

    # -- locking: serialises read-modify-write of one store across threads and processes ------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextmanager
    def task_lock(self, task: str) -> Iterator[None]:
        """Serialises decisions about one task id across threads and processes sharing this store
        (replicas): claiming a new id, committing a job's result, deleting. Taken before `_locked`,
        never inside it. A lock file may be swept (`sweep_task_locks`) once its task is gone: a
        holder checks, once it has the lock, that the file it locked is still the one at the path
        (else it was swept meanwhile, and it locks the new one)."""
        validate_task_id(task)
        path = self.root / "locks" / f"task-{task}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            f = open(path, "a+")  # noqa: SIM115 - closed below or after the block
            fcntl.flock(f, fcntl.LOCK_EX)
            if _same_file(f, path):
                break
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
            f.close()

    def sweep_task_locks(self) -> int:
        """Remove the lock files of tasks that do not exist (deleted, or never created), each under
        its own lock and only if nobody holds it. Returns how many."""
        removed = 0
        for path in (self.root / "locks").glob("task-*.lock"):
            task = path.name[len("task-"):-len(".lock")]
            if self.has_task(task):
                continue
            with open(path, "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use: a registration or a delete is deciding about it
                try:
                    if not self.has_task(task) and _same_file(f, path):
                        path.unlink()
                        removed += 1
                finally:
                    fcntl.flock(f, fcntl.LOCK_UN)
        return removed

    # -- inventory --------------------------------------------------------------------------
    @property
    def _inv_dir(self) -> Path:
        return self.root / "inventory"

    def has_inventory(self) -> bool:
        return (self._inv_dir / "inventory.json").is_file()

    def save_inventory(
        self,
        spec: InventorySpec,
        layer_names: list[str],
        layer_dims: list[tuple[int, int]],
        skills: dict[str, torch.Tensor],
        *,
        backbone_fingerprint: str,
        backbone_name: str = "",
        made_by: dict[str, Any] | None = None,
        dtype: torch.dtype | None = None,
    ) -> InventoryInfo:
        tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in skills.items()}
        expected = {f"{n}.{ab}" for n in layer_names for ab in "AB"}
        if set(tensors) != expected:
            raise StoreError(f"skills must hold exactly {len(expected)} tensors named <layer>.A/.B")
        info = InventoryInfo(
            spec=spec,
            layer_names=tuple(layer_names),
            layer_dims=tuple(tuple(d) for d in layer_dims),  # type: ignore[misc]
            backbone_fingerprint=backbone_fingerprint,
            backbone_name=backbone_name,
            version=tensors_digest(tensors)[:12],
            created_at=time.time(),
            made_by=made_by or {},
        )
        with self._locked():
            atomic_write_bytes(self._inv_dir / "skills.safetensors", st_save(tensors, {"version": info.version}))
            atomic_write_json(self._inv_dir / "inventory.json", info.to_json())
        return info

    def inventory_info(self) -> InventoryInfo:
        if not self.has_inventory():
            raise StoreError(f"no skill inventory in {self.root} (train one with `polyserve train`)")
        return InventoryInfo.from_json(read_json(self._inv_dir / "inventory.json"))

    def load_inventory(self, expected_fingerprint: str | None = None) -> tuple[InventoryInfo, dict[str, torch.Tensor]]:
        """The inventory and its skills; refuses one trained on another backbone."""
        info = self.inventory_info()
        if expected_fingerprint is not None and info.backbone_fingerprint != expected_fingerprint:
            raise FingerprintMismatch(
                f"inventory in {self.root} was trained on backbone {info.backbone_name or '?'} "
                f"({info.backbone_fingerprint}), but the loaded backbone is {expected_fingerprint}"
            )
        tensors = st_load((self._inv_dir / "skills.safetensors").read_bytes())
        if tensors_digest(tensors)[:12] != info.version:
            raise StoreError(f"skills.safetensors in {self.root} does not match inventory.json (version)")
        return info, tensors

    # -- tasks ----------------------------------------------------------------------------
    def _task_dir(self, task: str) -> Path:
        return self.root / "tasks" / validate_task_id(task)

    def list_tasks(self) -> list[TaskRecord]:
        records = []
        for path in sorted((self.root / "tasks").glob("*/task.json")):
            try:
                records.append(TaskRecord.from_json(read_json(path)))
            except (ValueError, KeyError, TypeError):
                continue  # unreadable entries are reported by `get_task`, not by listings
        return records

    def task_stamps(self) -> dict[str, tuple[int, int]]:
        """{task id: (inode, mtime_ns) of its task.json}: changes whenever the task is rewritten
        (every write is a rename onto a new inode). Cheap: stats only, no JSON is read."""
        stamps = {}
        with os.scandir(self.root / "tasks") as entries:
            for entry in entries:
                try:
                    st = os.stat(os.path.join(entry.path, "task.json"))
                except OSError:
                    continue
                stamps[entry.name] = (st.st_ino, st.st_mtime_ns)
        return stamps

    def has_task(self, task: str) -> bool:
        return (self._task_dir(task) / "task.json").is_file()

    def get_task(self, task: str) -> TaskRecord:
        path = self._task_dir(task) / "task.json"
        if not path.is_file():
            raise TaskNotFound(task)
        return TaskRecord.from_json(read_json(path))

    def put_record(self, record: TaskRecord) -> TaskRecord:
        """Write a registry entry as is (e.g. status 'training' or 'failed' without weights)."""
        validate_task_id(record.id)
        atomic_write_json(self._task_dir(record.id) / "task.json", record.to_json())
        return record

    def _put_weights(
        self, task: str, kind: str, tensors: dict[str, torch.Tensor], method: str,
        source: dict[str, Any] | None, metrics: dict[str, Any] | None, job_id: str | None,
    ) -> TaskRecord:
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        digest = tensors_digest(tensors)
        inv_version = self.inventory_info().version if self.has_inventory() else None
        with self._locked():
            previous = self.get_task(task) if self.has_task(task) else None
            version = (previous.version if previous else 0) + 1
            now = time.time()
            filename = f"{kind}-{version}-{digest}.safetensors"
            atomic_write_bytes(self._task_dir(task) / filename, st_save(tensors, {"task": task}))
            record = TaskRecord(
                id=task, method=method, status="ready", version=version,
                created_at=previous.created_at if previous else now, updated_at=now,
                kind=kind, file=filename, digest=digest,  # type: ignore[arg-type]
                params=sum(t.numel() for t in tensors.values()),
                source=source or {}, metrics=metrics or {}, job_id=job_id, inventory_version=inv_version,
                # a new version keeps its owner (set by the registration's placeholder record)
                owner=previous.owner if previous else None, shared=previous.shared if previous else False,
            )
            self.put_record(record)  # the commit point
            if previous and previous.file and previous.file != filename:
                (self._task_dir(task) / previous.file).unlink(missing_ok=True)
        return record

    def put_routing(
        self, task: str, logits: torch.Tensor, *, method: str = "routing",
        source: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None, job_id: str | None = None,
    ) -> TaskRecord:
        """Store a task's routing row. logits: (L, h, S) in the inventory's layer order."""
        if self.has_inventory():
            info = self.inventory_info()
            want = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
            if tuple(logits.shape) != want:
                raise StoreError(f"routing for {task!r} has shape {tuple(logits.shape)}, inventory needs {want}")
        return self._put_weights(task, "routing", {"logits": logits}, method, source, metrics, job_id)

    def put_lora(
        self, task: str, lora: dict[str, torch.Tensor], *, method: str,
        source: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None, job_id: str | None = None,
    ) -> TaskRecord:
        """Store a task's own plain LoRA: "<layer>.A" (d_in, r), "<layer>.B" (r, d_out)."""
        return self._put_weights(task, "lora", lora, method, source, metrics, job_id)

    def load_weights(self, record: TaskRecord) -> dict[str, torch.Tensor]:
        if record.status != "ready" or not record.file:
            raise StoreError(f"task {record.id!r} has no weights (status {record.status})")
        return st_load((self._task_dir(record.id) / record.file).read_bytes())

    def load_routing(self, task: str) -> torch.Tensor:
        record = self.get_task(task)
        if record.kind != "routing":
            raise StoreError(f"task {task!r} is a {record.kind} adapter, not a routing row")
        return self.load_weights(record)["logits"]

    def routing_rows(self, *, limit: int, exclude: str | None = None) -> dict[str, torch.Tensor]:
        """Up to `limit` ready tasks' routing rows {id: (L, h, S)} made for this store's current
        inventory, most recently updated first: the library a new task is retrieved from."""
        version = self.inventory_info().version if self.has_inventory() else None
        records = [r for r in self.list_tasks()
                   if r.kind == "routing" and r.status == "ready" and r.id != exclude
                   and r.inventory_version in (None, version)]
        records.sort(key=lambda r: (-r.updated_at, r.id))
        rows = {}
        for record in records[:limit]:
            try:
                rows[record.id] = self.load_weights(record)["logits"]
            except Exception as err:  # noqa: BLE001 - deleted, rewritten or unreadable meanwhile
                log.warning("task %r left out of retrieval: %s", record.id, err)
        return rows

    def delete_task(self, task: str) -> TaskRecord:
        with self._locked():
            record = self.get_task(task)
            self._remove_task_dir(task)
        return record

    def settle_placeholder(self, task: str, job_id: str, *, error: str | None) -> None:
        """A job that ended without a result: while the task is still this job's and not ready, it
        is removed (cancelled: `error` None) or marked "failed" with `error`; otherwise left alone.
        Checked and changed under the store lock, so a delete through another replica cannot land
        between the check and the change (the loser used to raise TaskNotFound, or resurrect the
        task as "failed")."""
        with self._locked():
            if not self.has_task(task):
                return
            record = self.get_task(task)
            if record.job_id != job_id or record.status == "ready":
                return  # another job's now, or committed (a serve_early version keeps serving)
            if error is None:
                self._remove_task_dir(task)
            else:
                self.put_record(replace(record, status="failed", updated_at=time.time(), error=error))

    def _remove_task_dir(self, task: str) -> None:
        directory = self._task_dir(task)
        # Remove the commit point first: a crash afterwards leaves only unreferenced files.
        (directory / "task.json").unlink()
        shutil.rmtree(directory, ignore_errors=True)

    # -- jobs -----------------------------------------------------------------------------
    def _job_path(self, job_id: str) -> Path:
        if not JOB_ID_RE.match(job_id):
            raise JobNotFound(job_id)
        return self.root / "jobs" / f"{job_id}.json"

    def put_job(self, job: dict[str, Any]) -> None:
        atomic_write_json(self._job_path(job["id"]), job)

    def get_job(self, job_id: str) -> dict[str, Any]:
        path = self._job_path(job_id)
        if not path.is_file():
            raise JobNotFound(job_id)
        return read_json(path)

    def put_job_examples(self, job_id: str, examples: list[dict[str, str]]) -> None:
        self._job_path(job_id)  # validates the id
        atomic_write_json(self.root / "jobs" / "examples" / f"{job_id}.json", examples)

    def get_job_examples(self, job_id: str) -> list[dict[str, str]]:
        self._job_path(job_id)
        return read_json(self.root / "jobs" / "examples" / f"{job_id}.json")

    def job_lock_path(self, job_id: str) -> Path:
        self._job_path(job_id)
        path = self.root / "jobs" / "locks" / f"{job_id}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def request_cancel(self, job_id: str) -> None:
        """Ask whichever replica runs the job to stop it (a marker it checks every slice)."""
        self._job_path(job_id)
        atomic_write_bytes(self.root / "jobs" / "cancel" / job_id, b"")

    def cancel_requested(self, job_id: str) -> bool:
        return (self.root / "jobs" / "cancel" / job_id).exists()

    def prune_jobs(self, older_than: float) -> int:
        """Remove finished jobs that ended before `older_than` (epoch seconds) with their example
        file, cancel marker and lock file; unfinished jobs are never touched. Returns how many."""
        removed = 0
        for data in self.list_jobs():
            finished_at = data.get("finished_at")
            if data.get("status") not in ("succeeded", "failed", "cancelled") or not finished_at:
                continue
            if finished_at >= older_than:
                continue
            job_id = data["id"]
            for path in (self.root / "jobs" / "examples" / f"{job_id}.json", self.root / "jobs" / "cancel" / job_id,
                         self.root / "jobs" / "locks" / f"{job_id}.lock", self._job_path(job_id)):
                path.unlink(missing_ok=True)  # the job file last: a crash leaves it to prune again
            removed += 1
        return removed

    def list_jobs(self) -> list[dict[str, Any]]:
        """Every readable job record. Another replica may prune a job between the listing and the
        read (replicas starting together both prune): a file gone meanwhile is skipped, and an
        unreadable one is logged and skipped, never an error that would stop a start-up."""
        jobs = []
        for path in sorted((self.root / "jobs").glob("job-*.json")):
            if path.name.startswith(TMP_PREFIX):
                continue
            try:
                data = read_json(path)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as err:
                log.warning("job record %s skipped: %s", path.name, type(err).__name__)
                continue
            if isinstance(data, dict) and isinstance(data.get("id"), str):
                jobs.append(data)
            else:
                log.warning("job record %s skipped: not a job", path.name)
        return jobs
