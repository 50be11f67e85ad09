"""The task registry: which tasks exist, whether they can be served, and their adapters.

The store on disk is the source of truth (other processes — `polyserve adapt`, the job runner —
write there); the registry reads task records from it on demand and resolves a servable task to
its materialised adapter through the cache tiers. Issue #5 adds create/delete/jobs on top:
`register_listener` lets them refresh gauges, `forget` drops cached adapters of a changed task.
"""

from __future__ import annotations

import threading
from typing import Any

from adapters_store.errors import TaskNotFound
from adapters_store.ids import RESERVED_TASK_IDS, validate_task_id
from adapters_store.mix import is_mix
from adapters_store.records import DEFAULT_PROMPT_FORMAT, TaskRecord
from adapters_store.store import Store
from server.adapters.cache import AdapterCache
from server.adapters.types import Adapter
from server.errors import ApiError
from server.mixes import mix_prompt_format, resolve_mix
from server.similar_index import RoutingIndex

BASE = "base"


class TaskNotReady(ApiError):
    def __init__(self, task: str, status: str, job_id: str | None = None) -> None:
        job = f"; job {job_id}" if job_id else ""
        super().__init__(409, "task_not_ready", f"task {task!r} is not ready (status {status!r}{job})")
        self.job_id = job_id


class TaskRegistry:
    def __init__(self, store: Store, cache: AdapterCache | None, metrics: Any = None) -> None:
        self.store = store
        self.cache = cache
        self.metrics = metrics
        self._lock = threading.Lock()
        # task search by routing row (GET /v1/tasks/{task}/similar)
        self.routing_index = RoutingIndex(store, cache.info) if cache is not None else None
        if self.routing_index is not None:
            threading.Thread(target=self.routing_index.warm, name="polyserve-routing-index", daemon=True).start()
        self.refresh()

    @property
    def inventory_version(self) -> str | None:
        return self.cache.info.version if self.cache is not None else None

    def refresh(self) -> int:
        """Re-read the store's task list; updates tasks_registered. Returns the count."""
        count = len(self.store.task_stamps())
        if self.metrics is not None:
            self.metrics.tasks_registered.set(count)
        return count

    def list(self) -> list[TaskRecord]:
        records = self.store.list_tasks()
        if self.metrics is not None:
            self.metrics.tasks_registered.set(len(records))
        return records

    def get(self, task: str) -> TaskRecord:
        """The stored record; raises ValueError (bad id) or TaskNotFound."""
        validate_task_id(task)
        if task in RESERVED_TASK_IDS:
            raise TaskNotFound(task)
        return self.store.get_task(task)

    def servable(self, record: TaskRecord) -> bool:
        return (record.status == "ready" and self.cache is not None
                and record.inventory_version in (None, self.inventory_version))

    def resolve(self, task: str) -> Adapter | None:
        """The adapter a request for `task` runs with (None = the bare backbone).
        Raises ValueError (malformed id), TaskNotFound (404), TaskNotReady (409). Blocking.
        A mix `mix:ID=W,...` resolves to its members' combined adapter (server.mixes)."""
        if is_mix(task):
            return resolve_mix(self, task)
        validate_task_id(task)
        if task == BASE:
            return None
        record = self.store.get_task(task)
        if record.status != "ready":
            raise TaskNotReady(task, record.status, record.job_id)
        if self.cache is None:
            raise TaskNotReady(task, "no skill inventory loaded")
        if record.inventory_version not in (None, self.inventory_version):
            raise TaskNotReady(task, f"trained on inventory {record.inventory_version}")
        return self.cache.get(record)

    def prompt_format(self, task: str) -> str:
        """The prompt format `task` was trained with (`base`: the default one). Blocking."""
        if task == BASE:
            return DEFAULT_PROMPT_FORMAT
        if is_mix(task):
            return mix_prompt_format(self, task)
        return self.store.get_task(task).prompt_format

    def forget(self, task: str) -> int:
        """A task changed or went away: drop its cached adapters and refresh the gauge."""
        dropped = self.cache.forget(task) if self.cache is not None else 0
        self.refresh()
        return dropped
