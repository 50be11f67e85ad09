"""The store contract: what every store backend keeps and how it changes, written once.

Two backends implement it: the directory store (`adapters_store.store.directory.DirectoryStore`, the embedded
default) and the PostgreSQL store (`adapters_store.store.postgres.PostgresStore`, for a fleet). The
semantics live here: versioning, validation, the commit point of a task write, what a delete or a
job's settle does, retrieval's choice of rows, job retention. A backend supplies only primitives
(read/write one record, one blob, one job) and two kinds of lock:

    _transaction(task)   a read-modify-write that no other process interleaves with
                         (directory: the store-wide fcntl lock; PostgreSQL: one transaction
                          holding the task's advisory transaction lock)
    task_lock(task)      a longer decision about one id across processes (claim a new id,
                          commit a job's result): taken before `_transaction`, never inside it
    hold_job(job_id)     a claim on a job that the process's death releases (recover() tells a
                         job whose runner died from one still running elsewhere)
    _queue_*             the fleet's job queue with leases (adapters_store.store.job_queue says what
                         they mean; PostgreSQL claims with FOR UPDATE SKIP LOCKED)

tests/adapters_store/store/test_contract.py runs the same suite against both backends.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from adapters_store.lora.spec import InventorySpec
from adapters_store.store.errors import FingerprintMismatch, JobNotFound, StoreError, TaskNotFound
from adapters_store.store.ids import validate_task_id
from adapters_store.store.job_queue import JobLease, new_token
from adapters_store.store.records import InventoryInfo, TaskRecord, check_quality

JOB_ID_RE = re.compile(r"^job-[a-z0-9]{6,40}$")
TERMINAL_JOB_STATES = ("succeeded", "failed", "cancelled")

log = logging.getLogger(__name__)


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise JobNotFound(job_id)
    return job_id


class JobHold(Protocol):
    """A live claim on a job, released by `release()` or by the holder's death (a lock), or by
    its lease running out (a queued job's JobLease). `still_held()`: nobody else took it over."""

    def release(self) -> None: ...

    def still_held(self) -> bool: ...


def check_record_quality(record: TaskRecord) -> None:
    """The record's `quality` is well formed (records.check_quality), or StoreError naming the task."""
    try:
        check_quality(record.quality)
    except ValueError as err:
        raise StoreError(f"task {record.id!r}: {err}") from None


def check_demonstrations(demonstrations: list[dict[str, str]]) -> list[dict[str, str]]:
    """A record's demonstrations as stored: {"input", "output"} strings, nothing else."""
    out = []
    for d in demonstrations:
        if set(d) != {"input", "output"} or not all(isinstance(v, str) and v for v in d.values()):
            raise StoreError("a demonstration is {\"input\": str, \"output\": str}, both non-empty")
        out.append({"input": d["input"], "output": d["output"]})
    return out


class AdapterStore(ABC):
    """Semantics shared by every backend; see the module docstring for the primitives."""

    # -- identity -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def location(self) -> str:
        """Where the store is, for logs and operator-facing errors (a path or a DSN without its
        password). Never shown to API clients."""

    # -- primitives: inventory ------------------------------------------------------------------
    @abstractmethod
    def _read_inventory_json(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def _read_skills_bytes(self, info: InventoryInfo) -> bytes: ...

    @abstractmethod
    def _write_inventory(self, info: InventoryInfo, skills: bytes) -> None:
        """Make `info` (with these skills) the store's inventory, atomically."""

    # -- primitives: tasks ----------------------------------------------------------------------
    @abstractmethod
    def _transaction(self, task: str | None = None) -> AbstractContextManager[None]: ...

    @abstractmethod
    def task_lock(self, task: str) -> AbstractContextManager[None]: ...

    @abstractmethod
    def _read_record(self, task: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def _record_dicts(self) -> Iterator[dict[str, Any]]:
        """Every task's record as stored (unreadable ones skipped), in task id order."""

    @abstractmethod
    def _read_blob(self, record: TaskRecord) -> bytes: ...

    @abstractmethod
    def _commit_task(self, record: TaskRecord, blob: bytes | None, previous: TaskRecord | None) -> None:
        """Write `blob` (if any) and then `record`, the commit point; drop `previous`'s blob if
        the record no longer names it. Called inside `_transaction(record.id)`."""

    @abstractmethod
    def _remove_task(self, task: str) -> None:
        """Remove the task's record (first) and its blobs. Called inside `_transaction(task)`."""

    @abstractmethod
    def task_stamps(self) -> dict[str, Any]:
        """{task id: a stamp that changes whenever the task is rewritten}, without reading records."""

    def sweep_task_locks(self) -> int:
        """Remove what per-id locks left behind for ids that have no task; returns how many.
        Backends whose locks leave nothing behind (PostgreSQL's advisory locks) have nothing to do."""
        return 0

    @abstractmethod
    def shared_secret(self, name: str) -> bytes:
        """A random secret that every node of this store shares (the key that signs L2 entries),
        made once by the first node that asks and kept by the store."""

    def change_cursor(self) -> int | None:
        """A number that moves whenever any task changes, read in O(1), or None where the backend
        has none (then a re-scan compares `task_stamps`)."""
        return None

    def subscribe(self, on_change: Callable[[str | None], None]) -> Callable[[], None] | None:
        """Push task changes made by any process: `on_change(task)`, or `on_change(None)` when some
        may have been missed (re-scan). Returns a function that stops it, or None where the backend
        pushes nothing (Redis pub/sub and re-scans then carry changes)."""
        return None

    # -- primitives: jobs -----------------------------------------------------------------------
    @abstractmethod
    def _write_job(self, job: dict[str, Any]) -> None: ...

    @abstractmethod
    def _write_job_if_held(self, job: dict[str, Any], token: str) -> bool:
        """Write the job only while its queue entry's lease token is `token`, in one step that a
        claim cannot cut in two (a claim that lands first makes it write nothing; one that comes
        after waits or skips the job until the write is done). Returns whether it wrote."""

    @abstractmethod
    def _read_job(self, job_id: str) -> dict[str, Any] | None: ...

    @abstractmethod
    def _job_dicts(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def _write_examples(self, job_id: str, examples: list[dict[str, str]]) -> None: ...

    @abstractmethod
    def _read_examples(self, job_id: str) -> list[dict[str, str]] | None: ...

    @abstractmethod
    def _mark_cancel(self, job_id: str) -> None: ...

    @abstractmethod
    def _cancel_marked(self, job_id: str) -> bool: ...

    @abstractmethod
    def _delete_job(self, job_id: str) -> None:
        """Remove the job's examples, cancel marker, claim leftovers, then the job itself last."""

    @abstractmethod
    def hold_job(self, job_id: str) -> JobHold | None:
        """Claim the job for this process without waiting; None if a live process holds it."""

    # -- primitives: the job queue (adapters_store.store.job_queue) -----------------------------------
    @abstractmethod
    def _queue_add(self, job_id: str) -> None:
        """Make the job claimable (no lease), once; enqueuing it again changes nothing."""

    @abstractmethod
    def _queue_claim(self, owner: str, token: str, lease_seconds: float,
                     job_id: str | None = None) -> tuple[str, int] | None:
        """Give the oldest job whose lease is free or expired (`job_id`: that job alone, if so) this
        token and owner, the lease `lease_seconds` from now, one more attempt, in one atomic step.
        Returns (job id, attempts), None when nothing is claimable."""

    @abstractmethod
    def _queue_renew(self, job_id: str, token: str, lease_seconds: float) -> bool:
        """While the job's token is `token`: its lease ends `lease_seconds` from now (0: at once).
        Returns whether the token was still the job's."""

    @abstractmethod
    def _queue_holds(self, job_id: str, token: str) -> bool: ...

    @abstractmethod
    def _queue_remove(self, job_id: str, token: str | None) -> None:
        """Remove the job's queue entry if its token is `token` (None: whatever it is)."""

    @abstractmethod
    def _queue_has(self, job_id: str) -> bool: ...

    @abstractmethod
    def _queue_size(self) -> int:
        """Jobs in the queue, leased or not."""

    @abstractmethod
    def _queue_size_of(self, tenant: str) -> int:
        """Jobs in the queue, leased or not, whose record names `tenant`."""

    @abstractmethod
    def _install_lock(self) -> AbstractContextManager[None]:
        """Serialises installing an inventory into an empty store across processes."""

    def install_once(self, install: Callable[[AdapterStore], bool]) -> bool:
        """Run `install(self)` unless the store already has an inventory, while every other process
        trying the same waits: processes starting together against an empty store install the
        default inventory exactly once. Returns what `install` returned, False if it did not run."""
        with self._install_lock():
            return False if self.has_inventory() else bool(install(self))

    # -- inventory ------------------------------------------------------------------------------
    def has_inventory(self) -> bool:
        return self._read_inventory_json() is not None

    def save_inventory(
        self, spec: InventorySpec, layer_names: list[str], layer_dims: list[tuple[int, int]],
        skills: dict[str, torch.Tensor], *, backbone_fingerprint: str, backbone_name: str = "",
        made_by: dict[str, Any] | None = None, dtype: torch.dtype | None = None,
    ) -> InventoryInfo:
        tensors = {k: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in skills.items()}
        expected = {f"{n}.{ab}" for n in layer_names for ab in "AB"}
        if set(tensors) != expected:
            raise StoreError(f"skills must hold exactly {len(expected)} tensors named <layer>.A/.B")
        info = InventoryInfo(
            spec=spec, layer_names=tuple(layer_names),
            layer_dims=tuple(tuple(d) for d in layer_dims),  # type: ignore[misc]
            backbone_fingerprint=backbone_fingerprint, backbone_name=backbone_name,
            version=tensors_digest(tensors)[:12], created_at=time.time(), made_by=made_by or {},
        )
        self._write_inventory(info, st_save(tensors, {"version": info.version}))
        return info

    def import_inventory(self, info: InventoryInfo, skills: bytes) -> None:
        """Install an inventory exactly as another store holds it (copy, default install); its
        skills must match its version."""
        if tensors_digest(st_load(skills))[:12] != info.version:
            raise StoreError(f"the skills given do not match inventory version {info.version}")
        self._write_inventory(info, skills)

    def inventory_info(self) -> InventoryInfo:
        data = self._read_inventory_json()
        if data is None:
            raise StoreError(f"no skill inventory in {self.location} (train one with `polyserve train`)")
        return InventoryInfo.from_json(data)

    def inventory_bytes(self) -> tuple[InventoryInfo, bytes]:
        """The inventory and its skills as stored (safetensors bytes), checked against its version."""
        info = self.inventory_info()
        blob = self._read_skills_bytes(info)
        if tensors_digest(st_load(blob))[:12] != info.version:
            raise StoreError(f"the skills stored in {self.location} do not match the inventory's version: "
                             "the skills file does not match inventory.json")
        return info, blob

    def load_inventory(self, expected_fingerprint: str | None = None) -> tuple[InventoryInfo, dict[str, torch.Tensor]]:
        """The inventory and its skills; refuses one trained on another backbone."""
        info = self.inventory_info()
        if expected_fingerprint is not None and info.backbone_fingerprint != expected_fingerprint:
            raise FingerprintMismatch(
                f"inventory in {self.location} was trained on backbone {info.backbone_name or '?'} "
                f"({info.backbone_fingerprint}), but the loaded backbone is {expected_fingerprint}"
            )
        _info, blob = self.inventory_bytes()
        return info, st_load(blob)

    # -- tasks ----------------------------------------------------------------------------------
    def list_tasks(self) -> list[TaskRecord]:
        records = []
        for data in self._record_dicts():
            try:
                records.append(TaskRecord.from_json(data))
            except (ValueError, KeyError, TypeError):
                continue  # unreadable entries are reported by `get_task`, not by listings
        return records

    def has_task(self, task: str) -> bool:
        return self._read_record(validate_task_id(task)) is not None

    def get_task(self, task: str) -> TaskRecord:
        data = self._read_record(validate_task_id(task))
        if data is None:
            raise TaskNotFound(task)
        return TaskRecord.from_json(data)

    def get_tasks(self, tasks: list[str]) -> dict[str, TaskRecord]:
        """{id: record} for those of `tasks` that exist and are readable (a listing's re-read of
        the tasks that changed: adapters_store/store/snapshot.py). Never reads weights."""
        records = {}
        for task, data in self._read_records(tasks):
            try:
                records[task] = TaskRecord.from_json(data)
            except (ValueError, KeyError, TypeError):
                continue  # unreadable entries are reported by `get_task`, not by listings
        return records

    def _read_records(self, tasks: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        """(id, record as stored) for those of `tasks` that exist; a backend may read them at once."""
        for task in tasks:
            try:
                data = self._read_record(task)
            except (OSError, ValueError):
                continue  # removed meanwhile, or unreadable
            if data is not None:
                yield task, data

    def put_record(self, record: TaskRecord) -> TaskRecord:
        """Write a registry entry as is (e.g. status 'training' or 'failed' without weights)."""
        validate_task_id(record.id)
        check_record_quality(record)
        with self._transaction(record.id):
            data = self._read_record(record.id)
            self._commit_task(record, None, TaskRecord.from_json(data) if data else None)
        return record

    def _put_weights(
        self, task: str, kind: str, tensors: dict[str, torch.Tensor], method: str,
        source: dict[str, Any] | None, metrics: dict[str, Any] | None, job_id: str | None,
        demonstrations: list[dict[str, str]] | None = None,
    ) -> TaskRecord:
        validate_task_id(task)
        demonstrations = check_demonstrations(demonstrations or [])
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        weights = kind != "demos"  # a demos task is its demonstrations alone: no weights file
        digest = tensors_digest(tensors) if weights else None
        blob = st_save(tensors, {"task": task}) if weights else None
        inv = self._read_inventory_json()
        with self._transaction(task):
            data = self._read_record(task)
            previous = TaskRecord.from_json(data) if data else None
            version = (previous.version if previous else 0) + 1
            now = time.time()
            record = TaskRecord(
                id=task, method=method, status="ready", version=version,
                created_at=previous.created_at if previous else now, updated_at=now,
                kind=kind,  # type: ignore[arg-type]
                file=f"{kind}-{version}-{digest}.safetensors" if weights else None, digest=digest,
                params=sum(t.numel() for t in tensors.values()),
                source=source or {}, metrics=metrics or {}, job_id=job_id,
                inventory_version=inv["version"] if inv else None,
                # a new version keeps its owner and what it says of itself (set by the registration's
                # placeholder record)
                owner=previous.owner if previous else None, shared=previous.shared if previous else False,
                description=previous.description if previous else None,
                examples=list(previous.examples) if previous else [], demonstrations=demonstrations,
                # no `quality`: it was measured on the previous version's weights, not these
            )
            self._commit_task(record, blob, previous)
        return record

    def put_routing(
        self, task: str, logits: torch.Tensor, *, method: str = "routing",
        source: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None, job_id: str | None = None,
        demonstrations: list[dict[str, str]] | None = None,
    ) -> TaskRecord:
        """Store a task's routing row. logits: (L, h, S) in the inventory's layer order."""
        if self.has_inventory():
            info = self.inventory_info()
            want = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
            if tuple(logits.shape) != want:
                raise StoreError(f"routing for {task!r} has shape {tuple(logits.shape)}, inventory needs {want}")
        return self._put_weights(task, "routing", {"logits": logits}, method, source, metrics, job_id, demonstrations)

    def put_lora(
        self, task: str, lora: dict[str, torch.Tensor], *, method: str,
        source: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None, job_id: str | None = None,
        demonstrations: list[dict[str, str]] | None = None,
    ) -> TaskRecord:
        """Store a task's own plain LoRA: "<layer>.A" (d_in, r), "<layer>.B" (r, d_out)."""
        return self._put_weights(task, "lora", lora, method, source, metrics, job_id, demonstrations)

    def put_demonstrations(
        self, task: str, demonstrations: list[dict[str, str]], *, method: str,
        source: dict[str, Any] | None = None, metrics: dict[str, Any] | None = None, job_id: str | None = None,
    ) -> TaskRecord:
        """Store a task served as its demonstrations on the bare backbone (kind "demos", no weights)."""
        if not demonstrations:
            raise StoreError(f"task {task!r}: a task without weights needs at least one demonstration")
        return self._put_weights(task, "demos", {}, method, source, metrics, job_id, demonstrations)

    def import_task(self, record: TaskRecord, blob: bytes | None) -> None:
        """Write a task exactly as another store holds it (its version, digest and times), e.g.
        `polyserve store copy`; the blob must match the record's digest."""
        validate_task_id(record.id)
        check_record_quality(record)
        if record.file:
            if blob is None or tensors_digest(st_load(blob)) != record.digest:
                raise StoreError(f"task {record.id!r}: its weights do not match its digest")
        elif blob is not None:
            raise StoreError(f"task {record.id!r} names no weights file, but weights were given")
        with self._transaction(record.id):
            data = self._read_record(record.id)
            self._commit_task(record, blob, TaskRecord.from_json(data) if data else None)

    def weights_bytes(self, record: TaskRecord, *, ready_only: bool = True) -> bytes:
        """The weights a record names, as stored (safetensors bytes). `ready_only=False` also reads
        those of a record that is not servable (a copy of the store takes every record as is)."""
        if not record.file or (ready_only and record.status != "ready"):
            raise StoreError(f"task {record.id!r} has no weights (status {record.status})")
        return self._read_blob(record)

    def load_weights(self, record: TaskRecord) -> dict[str, torch.Tensor]:
        return st_load(self.weights_bytes(record))

    def load_routing(self, task: str) -> torch.Tensor:
        record = self.get_task(task)
        if record.kind != "routing":
            raise StoreError(f"task {task!r} is a {record.kind} adapter, not a routing row")
        return self.load_weights(record)["logits"]

    def routing_rows(self, *, limit: int, exclude: str | None = None) -> dict[str, torch.Tensor]:
        """Up to `limit` ready tasks' routing rows {id: (L, h, S)} made for this store's current
        inventory, most recently updated first: the library a new task is retrieved from."""
        inv = self._read_inventory_json()
        version = inv["version"] if inv else None
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
        validate_task_id(task)
        with self._transaction(task):
            record = self.get_task(task)
            self._remove_task(task)
        return record

    def settle_placeholder(self, task: str, job_id: str, *, error: str | None) -> None:
        """A job that ended without a result: while the task is still this job's and not ready, it
        is removed (cancelled: `error` None) or marked "failed" with `error`; otherwise left alone.
        Checked and changed in one transaction, so a delete through another replica cannot land
        between the check and the change."""
        validate_task_id(task)
        with self._transaction(task):
            data = self._read_record(task)
            if data is None:
                return
            record = TaskRecord.from_json(data)
            if record.job_id != job_id or record.status == "ready":
                return  # another job's now, or committed (a serve_early version keeps serving)
            if error is None:
                self._remove_task(task)
            else:
                self._commit_task(replace(record, status="failed", updated_at=time.time(), error=error), None, record)

    # -- jobs -----------------------------------------------------------------------------------
    def put_job(self, job: dict[str, Any]) -> None:
        self._write_job({**job, "id": check_job_id(job["id"])})

    def put_job_if_held(self, job: dict[str, Any], token: str) -> bool:
        """A leased run's write: only while its lease is still `token` (no other claimer took the
        job over, which would make this run's state stale). Returns whether it wrote."""
        return self._write_job_if_held({**job, "id": check_job_id(job["id"])}, token)

    def get_job(self, job_id: str) -> dict[str, Any]:
        data = self._read_job(check_job_id(job_id))
        if data is None:
            raise JobNotFound(job_id)
        return data

    def list_jobs(self) -> list[dict[str, Any]]:
        return sorted(self._job_dicts(), key=lambda j: j["id"])

    def put_job_examples(self, job_id: str, examples: list[dict[str, str]]) -> None:
        self._write_examples(check_job_id(job_id), examples)

    def get_job_examples(self, job_id: str) -> list[dict[str, str]]:
        examples = self._read_examples(check_job_id(job_id))
        if examples is None:
            raise JobNotFound(job_id)
        return examples

    def request_cancel(self, job_id: str) -> None:
        """Ask whichever process runs the job to stop it (a marker it checks every slice)."""
        self._mark_cancel(check_job_id(job_id))

    def cancel_requested(self, job_id: str) -> bool:
        return self._cancel_marked(check_job_id(job_id))

    def enqueue_job(self, job_id: str) -> None:
        """Hand the job to the fleet's workers (its record, examples and placeholder written)."""
        self._queue_add(check_job_id(job_id))

    def claim_job(self, owner: str, lease_seconds: float, job_id: str | None = None) -> JobLease | None:
        """The oldest queued job nobody holds a live lease on, leased to `owner`; None if none.
        A job whose lease expired (its claimer died or stopped heart-beating) is claimable again.
        `job_id`: that job only (a replica cancelling a job no worker has taken yet)."""
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be positive, got {lease_seconds!r}")
        token = new_token()
        got = self._queue_claim(owner, token, lease_seconds, None if job_id is None else check_job_id(job_id))
        if got is None:
            return None
        job_id, attempts = got
        return JobLease(self, job_id, token, owner, lease_seconds, attempts)

    def queued_jobs(self, tenant: str | None = None) -> int:
        """How many jobs wait in (or are leased from) the fleet's queue: the workers' backlog;
        with `tenant`, those registered by that tenant only (its quota)."""
        return self._queue_size() if tenant is None else self._queue_size_of(tenant)

    def job_enqueued(self, job_id: str) -> bool:
        """Whether the job waits in (or is leased from) the queue: workers own it, not a replica."""
        return self._queue_has(check_job_id(job_id))

    def prune_jobs(self, older_than: float) -> int:
        """Remove finished jobs that ended before `older_than` (epoch seconds) with their examples,
        cancel marker and claim leftovers; unfinished jobs are never touched. Returns how many."""
        removed = 0
        for data in self._job_dicts():
            finished_at = data.get("finished_at")
            if data.get("status") not in TERMINAL_JOB_STATES or not finished_at or finished_at >= older_than:
                continue
            self._delete_job(data["id"])
            removed += 1
        return removed
