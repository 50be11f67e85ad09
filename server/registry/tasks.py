"""The task registry: which tasks exist, whether they can be served, and their adapters.

The store on disk is the source of truth (other processes — `polyserve adapt`, the job runner —
write there); the registry reads task records from it on demand and resolves a servable task to
its materialised adapter through the cache tiers. `forget` drops cached adapters of a changed task.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from adapters_store.backbone.prompt import format_prompt_as, format_target
from adapters_store.lora.mix import is_mix
from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import StoreUnavailable, TaskNotFound
from adapters_store.store.ids import RESERVED_TASK_IDS, validate_task_id
from adapters_store.store.records import DEFAULT_PROMPT_FORMAT, TaskRecord
from adapters_store.store.snapshot import TaskSnapshot
from server.adapter_cache.cache import AdapterCache
from server.adapter_cache.types import Adapter
from server.infra.metrics import Metrics
from server.registry.errors import TaskNotReady
from server.registry.mixes import mix_prompt_format, resolve_mix
from server.registry.ownership import can_see
from server.registry.similar_index import RoutingIndex
from server.tenancy.tenants import Tenant

BASE = "base"
# where an answer after demonstrations ends (training/demos.py ANSWER_END): served as a stop string
ANSWER_END = "\n"


@dataclass(frozen=True)
class TaskPrompt:
    """What a task puts around a request's input: its prompt format, and the demonstrations
    (input, output) placed before every prompt, in that format (training/demos.py)."""

    prompt_format: str
    demonstrations: tuple[tuple[str, str], ...] = ()

    def demonstration_text(self) -> str:
        return "".join(format_prompt_as(self.prompt_format, i) + format_target(o) + "\n\n"
                       for i, o in self.demonstrations)
HELD_RECORDS = 4096  # records kept for serving through a store outage (a few hundred bytes each)


class TaskRegistry:
    def __init__(self, store: AdapterStore, cache: AdapterCache | None, metrics: Metrics | None = None, *,
                 isolated: bool = False) -> None:
        self.store = store
        self.isolated = isolated  # tenants see only their own and shared tasks (server/registry/ownership.py)
        self.cache = cache
        self.metrics = metrics
        self._lock = threading.Lock()
        # the last record each recently served task ran with: while the store is unreachable these
        # tasks keep serving (their adapters are in memory); anything else answers 503
        self._held: OrderedDict[str, TaskRecord] = OrderedDict()
        # every task's record in memory for listings, re-read only where a stamp changed
        self.snapshot = TaskSnapshot(store)
        # task search by routing row (GET /v1/tasks/{task}/similar)
        self.routing_index = RoutingIndex(store, cache.info) if cache is not None else None
        if self.routing_index is not None:
            threading.Thread(target=self.routing_index.warm, name="polyserve-routing-index", daemon=True).start()
        self.refresh()

    @property
    def inventory_version(self) -> str | None:
        return self.cache.info.version if self.cache is not None else None

    def refresh(self) -> int:
        """Bring the snapshot of the task list up to date (at start: its first full read, so the
        first listing is as fast as the next); updates tasks_registered. Returns the count."""
        count = len(self.snapshot.records())
        if self.metrics is not None:
            self.metrics.tasks_registered.set(count)
        return count

    def list(self, tenant: Tenant | None = None) -> list[TaskRecord]:
        """Every task `tenant` may see (None: all), from the snapshot (adapters_store/store/snapshot.py)."""
        records = self.snapshot.records()
        if self.metrics is not None:
            self.metrics.tasks_registered.set(len(records))
        return [r for r in records if can_see(r, tenant, isolated=self.isolated)]

    def get(self, task: str, tenant: Tenant | None = None) -> TaskRecord:
        """The stored record; raises ValueError (bad id) or TaskNotFound (also: `tenant` may not
        see it, so that someone else's task looks absent)."""
        validate_task_id(task)
        if task in RESERVED_TASK_IDS:
            raise TaskNotFound(task)
        record = self.store.get_task(task)
        if not can_see(record, tenant, isolated=self.isolated):
            raise TaskNotFound(task)
        return record

    def _serving_record(self, task: str) -> TaskRecord:
        """The record a request for `task` runs with: the store's, or, while the store is
        unreachable, the one this replica last served it with (else StoreUnavailable -> 503)."""
        try:
            record = self.store.get_task(task)
        except StoreUnavailable:
            with self._lock:
                held = self._held.get(task)
            if held is None:
                raise
            return held
        except TaskNotFound:
            with self._lock:
                self._held.pop(task, None)
            raise
        with self._lock:
            self._held[task] = record
            self._held.move_to_end(task)
            while len(self._held) > HELD_RECORDS:
                self._held.popitem(last=False)
        return record

    def servable(self, record: TaskRecord) -> bool:
        return (record.status == "ready" and self.cache is not None
                and record.inventory_version in (None, self.inventory_version))

    def resolve(self, task: str, tenant: Tenant | None = None) -> Adapter | None:
        """The adapter a request for `task` runs with (None = the bare backbone).
        Raises ValueError (malformed id), TaskNotFound (404: also someone else's task),
        TaskNotReady (409). Blocking. A mix `mix:ID=W,...` resolves to its members' combined
        adapter (server.registry.mixes); every member must be visible to `tenant`."""
        if is_mix(task):
            return resolve_mix(self, task, tenant)
        validate_task_id(task)
        if task == BASE:
            return None
        record = self._serving_record(task)
        if not can_see(record, tenant, isolated=self.isolated):
            raise TaskNotFound(task)
        if record.status != "ready":
            raise TaskNotReady(task, record.status, record.job_id)
        if self.cache is None:
            raise TaskNotReady(task, "no skill inventory loaded")
        if record.inventory_version not in (None, self.inventory_version):
            raise TaskNotReady(task, f"trained on inventory {record.inventory_version}")
        if record.kind == "demos":  # its demonstrations on the bare backbone (TaskPrompt)
            return None
        return self.cache.get(record)

    def prompt(self, task: str, tenant: Tenant | None = None) -> TaskPrompt:
        """How a request for `task` is rendered: the prompt format it was trained with (`base`: the
        default one) and the demonstrations its version carries. Blocking. Raises ValueError
        (malformed id), TaskNotFound (also: `tenant` may not see it)."""
        if is_mix(task):  # a mix combines its members' adapters, not their demonstrations
            return TaskPrompt(mix_prompt_format(self, task, tenant))
        validate_task_id(task)
        if task == BASE:
            return TaskPrompt(DEFAULT_PROMPT_FORMAT)
        record = self._serving_record(task)
        if not can_see(record, tenant, isolated=self.isolated):
            raise TaskNotFound(task)
        return TaskPrompt(record.prompt_format, tuple((d["input"], d["output"]) for d in record.demonstrations))

    def prompt_format(self, task: str, tenant: Tenant | None = None) -> str:
        """The prompt format `task` was trained with (`base`: the default one)."""
        return self.prompt(task, tenant).prompt_format

    def forget(self, task: str) -> int:
        """A task changed or went away: drop its cached adapters and refresh the gauge."""
        with self._lock:
            self._held.pop(task, None)
        self.snapshot.mark(task)
        dropped = self.cache.forget(task) if self.cache is not None else 0
        self.refresh()
        return dropped
