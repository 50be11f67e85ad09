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
    <root>/jobs/queue/<id>.json            a job queued for workers and its lease (job_queue.py)

A task's weights file is written first, then task.json pointing at it; a crash in between
leaves the previous task.json (and an orphan file that `open` sweeps). Writing one task never
touches another task's files. The semantics are adapters_store.store.contract's; this file holds the
directory primitives (several processes on one machine, or on a filesystem with working fcntl
locks, share such a store).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from adapters_store.store.atomic import (
    TMP_PREFIX,
    atomic_write_bytes,
    atomic_write_json,
    read_json,
    sweep_temp_files,
)
from adapters_store.store.contract import AdapterStore, check_job_id, check_record_quality, tensors_digest
from adapters_store.store.ids import validate_task_id
from adapters_store.store.records import InventoryInfo, TaskRecord

__all__ = ["DirectoryStore", "tensors_digest"]

log = logging.getLogger(__name__)


def _same_file(f: Any, path: Path) -> bool:
    """Whether the open file `f` is still the file at `path` (not unlinked or replaced)."""
    try:
        return os.fstat(f.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


class _FileHold:
    """An fcntl lock on a job's lock file, held until released or until the process dies."""

    def __init__(self, f: IO[str], path: Path) -> None:
        self._f, self._path = f, path

    def release(self) -> None:
        if self._f.closed:
            return
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()
        self._path.unlink(missing_ok=True)

    def still_held(self) -> bool:
        return not self._f.closed


class DirectoryStore(AdapterStore):
    """The directory store (the embedded default)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()
        for sub in ("inventory", "tasks", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        sweep_temp_files(self.root)

    @property
    def location(self) -> str:
        return str(self.root)

    # -- locking: serialises read-modify-write of one store across threads and processes ------
    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _transaction(self, task: str | None = None) -> Any:
        return self._locked()

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

    @contextmanager
    def _install_lock(self) -> Iterator[None]:
        path = self.root / "locks" / "install.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    # -- inventory --------------------------------------------------------------------------
    @property
    def _inv_dir(self) -> Path:
        return self.root / "inventory"

    def _read_inventory_json(self) -> dict[str, Any] | None:
        path = self._inv_dir / "inventory.json"
        return read_json(path) if path.is_file() else None

    def _read_skills_bytes(self, info: InventoryInfo) -> bytes:
        return (self._inv_dir / "skills.safetensors").read_bytes()

    def _write_inventory(self, info: InventoryInfo, skills: bytes) -> None:
        with self._locked():
            atomic_write_bytes(self._inv_dir / "skills.safetensors", skills)
            atomic_write_json(self._inv_dir / "inventory.json", info.to_json())

    # -- tasks ----------------------------------------------------------------------------
    def _task_dir(self, task: str) -> Path:
        return self.root / "tasks" / validate_task_id(task)

    def _read_record(self, task: str) -> dict[str, Any] | None:
        path = self._task_dir(task) / "task.json"
        return read_json(path) if path.is_file() else None

    def _record_dicts(self) -> Iterator[dict[str, Any]]:
        for path in sorted((self.root / "tasks").glob("*/task.json")):
            try:
                yield read_json(path)
            except (OSError, ValueError):
                continue  # removed meanwhile, or unreadable

    def _read_blob(self, record: TaskRecord) -> bytes:
        return (self._task_dir(record.id) / str(record.file)).read_bytes()

    def _commit_task(self, record: TaskRecord, blob: bytes | None, previous: TaskRecord | None) -> None:
        directory = self._task_dir(record.id)
        if blob is not None:
            atomic_write_bytes(directory / str(record.file), blob)
        atomic_write_json(directory / "task.json", record.to_json())  # the commit point
        if previous and previous.file and previous.file != record.file:
            (directory / previous.file).unlink(missing_ok=True)

    def put_record(self, record: TaskRecord) -> TaskRecord:
        """The contract's put_record without the store-wide lock: a record alone is one atomic
        rename, and callers decide about an id under `task_lock`, so a registration's placeholder
        never waits for another process's write (which may hold the store lock for a long time)."""
        validate_task_id(record.id)
        check_record_quality(record)
        data = self._read_record(record.id)
        self._commit_task(record, None, TaskRecord.from_json(data) if data else None)
        return record

    def _remove_task(self, task: str) -> None:
        directory = self._task_dir(task)
        # Remove the commit point first: a crash afterwards leaves only unreferenced files.
        (directory / "task.json").unlink()
        shutil.rmtree(directory, ignore_errors=True)

    def task_stamps(self) -> dict[str, Any]:
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

    def shared_secret(self, name: str) -> bytes:
        """A file `name` under the root (mode 600, 32 random bytes), made once: the first process
        to link its file in wins, the others read that one."""
        path = self.root / name
        try:
            return path.read_bytes()
        except FileNotFoundError:
            pass
        tmp = path.with_name(f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return path.read_bytes()

    # -- jobs -----------------------------------------------------------------------------
    def _job_path(self, job_id: str) -> Path:
        return self.root / "jobs" / f"{check_job_id(job_id)}.json"

    def _write_job(self, job: dict[str, Any]) -> None:
        atomic_write_json(self._job_path(job["id"]), job)

    def _write_job_if_held(self, job: dict[str, Any], token: str) -> bool:
        with self._locked():  # the queue's lock: a claim waits for it
            entry = self._queue_entry(job["id"])
            if entry is None or entry.get("token") != token:
                return False
            atomic_write_json(self._job_path(job["id"]), job)
            return True

    def _read_job(self, job_id: str) -> dict[str, Any] | None:
        path = self._job_path(job_id)
        try:
            return read_json(path)
        except FileNotFoundError:
            return None

    def _job_dicts(self) -> list[dict[str, Any]]:
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

    def _examples_path(self, job_id: str) -> Path:
        return self.root / "jobs" / "examples" / f"{check_job_id(job_id)}.json"

    def _write_examples(self, job_id: str, examples: list[dict[str, str]]) -> None:
        atomic_write_json(self._examples_path(job_id), examples)

    def _read_examples(self, job_id: str) -> list[dict[str, str]] | None:
        try:
            return read_json(self._examples_path(job_id))
        except FileNotFoundError:
            return None

    def _cancel_path(self, job_id: str) -> Path:
        return self.root / "jobs" / "cancel" / check_job_id(job_id)

    def _mark_cancel(self, job_id: str) -> None:
        atomic_write_bytes(self._cancel_path(job_id), b"")

    def _cancel_marked(self, job_id: str) -> bool:
        return self._cancel_path(job_id).exists()

    def job_lock_path(self, job_id: str) -> Path:
        path = self.root / "jobs" / "locks" / f"{check_job_id(job_id)}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def hold_job(self, job_id: str) -> _FileHold | None:
        path = self.job_lock_path(job_id)
        f = open(path, "a+")  # noqa: SIM115 - held until released
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        return _FileHold(f, path)

    # -- the job queue: one small file per queued job, changed under the store-wide lock ----------
    def _queue_path(self, job_id: str) -> Path:
        return self.root / "jobs" / "queue" / f"{check_job_id(job_id)}.json"

    def _queue_add(self, job_id: str) -> None:
        with self._locked():
            path = self._queue_path(job_id)
            if not path.exists():
                atomic_write_json(path, {"id": job_id, "enqueued_at": time.time(), "owner": None, "token": None,
                                         "lease_until": None, "attempts": 0})

    def _queue_entry(self, job_id: str) -> dict[str, Any] | None:
        try:
            return read_json(self._queue_path(job_id))
        except FileNotFoundError:
            return None

    def _queue_claim(self, owner: str, token: str, lease_seconds: float,
                     job_id: str | None = None) -> tuple[str, int] | None:
        with self._locked():
            now = time.time()
            entries = []
            for path in (self.root / "jobs" / "queue").glob(f"{job_id or 'job-*'}.json"):
                try:
                    entries.append(read_json(path))
                except (OSError, ValueError):
                    continue  # removed meanwhile, or a write that never finished
            free = [e for e in entries if e.get("lease_until") is None or e["lease_until"] < now]
            if not free:
                return None
            entry = min(free, key=lambda e: (e["enqueued_at"], e["id"]))
            entry.update(owner=owner, token=token, lease_until=now + lease_seconds, attempts=entry["attempts"] + 1)
            atomic_write_json(self._queue_path(entry["id"]), entry)
            return entry["id"], entry["attempts"]

    def _queue_renew(self, job_id: str, token: str, lease_seconds: float) -> bool:
        with self._locked():
            entry = self._queue_entry(job_id)
            if entry is None or entry.get("token") != token:
                return False
            entry["lease_until"] = time.time() + lease_seconds
            atomic_write_json(self._queue_path(job_id), entry)
            return True

    def _queue_holds(self, job_id: str, token: str) -> bool:
        entry = self._queue_entry(job_id)
        return entry is not None and entry.get("token") == token

    def _queue_remove(self, job_id: str, token: str | None) -> None:
        with self._locked():
            entry = self._queue_entry(job_id)
            if entry is not None and (token is None or entry.get("token") == token):
                self._queue_path(job_id).unlink(missing_ok=True)

    def _queue_has(self, job_id: str) -> bool:
        return self._queue_path(job_id).exists()

    def _queue_size(self) -> int:
        return sum(1 for _ in (self.root / "jobs" / "queue").glob("job-*.json"))

    def _queue_size_of(self, tenant: str) -> int:
        # the queue is bounded (POLYSERVE_MAX_QUEUED_JOBS): one record read per entry
        records = (self._read_job(path.stem) for path in (self.root / "jobs" / "queue").glob("job-*.json"))
        return sum(1 for data in records if data is not None and data.get("tenant") == tenant)

    def _delete_job(self, job_id: str) -> None:
        for path in (self._examples_path(job_id), self._cancel_path(job_id), self._queue_path(job_id),
                     self.root / "jobs" / "locks" / f"{job_id}.lock", self._job_path(job_id)):
            path.unlink(missing_ok=True)  # the job file last: a crash leaves it to prune again
