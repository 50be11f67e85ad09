"""The routing index behind GET /v1/tasks/{task}/similar: every routed task's row, projected, kept in
step with the store.

    refresh():   store.task_stamps() (stats only); a task whose stamp changed is read again: its
                 inference weights w (L, h, S) -> v = unit(centred(w)) -> unit(v @ P), P (D, dim)
                 fixed (adapters_store.lora.similar.projection); rows of other inventories, plain
                 LoRAs and tasks not ready are remembered by stamp and left out
    similar(t, k):
        scores    = M @ p(t)                      M (N, dim): the projected rows (one GEMV)
        shortlist = the best max(k, shortlist) others by projected score
        answer    = the shortlist ranked by exact score (adapters_store.lora.similar), rows read again
So a query costs a stat per task (at most once per max_staleness seconds: a task registered or
changed since is seen by the next query after that), one (N, dim) GEMV and `shortlist` row reads,
and memory is
N * dim floats whatever the inventory's size. With N - 1 <= shortlist the answer is exact; beyond,
a true neighbour can miss the shortlist (recall measured in BENCHMARKS.md, "Other questions": task search).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapters_store.lora.similar import centred, projection, top_k, unit
from adapters_store.store.errors import TaskNotFound
from adapters_store.store.materialize import task_weights
from adapters_store.store.records import InventoryInfo, TaskRecord

log = logging.getLogger("polyserve.similar")


class NotRouted(ValueError):
    """The task has no routing row to compare (a plain LoRA, not ready, another inventory)."""


class _QueryGone(Exception):
    """The queried task's row could not be read: it changed or left since the index's refresh."""


@dataclass
class _Entry:
    stamp: tuple[int, int]
    record: TaskRecord | None  # None: not a ready routed task of this inventory
    row: torch.Tensor | None  # (dim,) projected unit row


class RoutingIndex:
    def __init__(self, store, info: InventoryInfo, *, dim: int = 256, shortlist: int = 64, seed: int = 0,
                 max_staleness: float = 1.0) -> None:
        """max_staleness: seconds a query may answer from the last refresh (a stat per task each
        time is what a query costs most at 10,000 tasks); 0: every query refreshes."""
        self.store, self.info, self.shortlist = store, info, shortlist
        self.max_staleness = max_staleness
        self._refreshed_at = -float("inf")
        d = len(info.layer_names) * info.spec.n_heads * info.spec.n_skills
        self.P = projection(d, dim, seed) if d > dim else None  # small rows are compared as they are
        self._entries: dict[str, _Entry] = {}
        self._ids: list[str] = []
        self._matrix = torch.zeros(0, dim if self.P is not None else d)
        self._lock = threading.Lock()

    def _exact(self, record: TaskRecord) -> torch.Tensor:
        """The task's unit centred row (D,), read from the store."""
        logits = self.store.load_weights(record)["logits"].float()
        return unit(centred(task_weights(self.info, logits)))

    def _read(self, task: str, stamp: tuple[int, int]) -> _Entry:
        try:
            record = self.store.get_task(task)
            if not (record.kind == "routing" and record.status == "ready"
                    and record.inventory_version in (None, self.info.version)):
                return _Entry(stamp, None, None)
            v = self._exact(record)
        except Exception as err:  # noqa: BLE001 - rewritten or deleted meanwhile: read again next time
            log.debug("task %r left out of the routing index: %s", task, err)
            return _Entry((-1, -1), None, None)
        row = v if self.P is None else unit(v @ self.P)
        return _Entry(stamp, record, row)

    def refresh(self) -> int:
        """Bring the index in step with the store; returns how many tasks were (re)read."""
        stamps = self.store.task_stamps()
        self._refreshed_at = time.monotonic()
        changed = 0
        for task in set(self._entries) - set(stamps):
            del self._entries[task]
            changed += 1
        for task, stamp in stamps.items():
            entry = self._entries.get(task)
            if entry is None or entry.stamp != stamp:
                self._entries[task] = self._read(task, stamp)
                changed += 1
        if changed:
            self._ids = sorted(t for t, e in self._entries.items() if e.row is not None)
            rows = [e.row for e in (self._entries[t] for t in self._ids) if e.row is not None]
            self._matrix = torch.stack(rows) if rows else self._matrix[:0]
        return changed

    def warm(self) -> None:
        """Read every task once (a server starts this in the background: the first query of a
        large store would otherwise read them all)."""
        try:
            with self._lock:
                self.refresh()
        except Exception:  # the first query refreshes again
            log.warning("routing index warm-up failed", exc_info=True)

    def __len__(self) -> int:
        return len(self._ids)

    def similar(self, task: str, k: int,
                visible: Callable[[TaskRecord], bool] | None = None) -> list[tuple[str, float]]:
        """The k tasks nearest to `task` by routing row, best first: (id, exact score); with
        `visible`, only tasks whose record passes it (a tenant's own and shared tasks).
        Raises TaskNotFound, NotRouted. Blocking (stats the store, reads a few rows)."""
        try:
            return self._similar(task, k, visible, refresh=False)
        except _QueryGone:  # deleted or rewritten since the last refresh: ask the store as it is now
            try:
                return self._similar(task, k, visible, refresh=True)
            except _QueryGone as again:
                if again.__cause__ is not None and self.store.has_task(task):
                    raise again.__cause__ from None  # its row is there and cannot be read: not a missing task
                raise TaskNotFound(task) from None  # gone again meanwhile

    def _similar(self, task: str, k: int, visible: Callable[[TaskRecord], bool] | None,
                 refresh: bool) -> list[tuple[str, float]]:
        with self._lock:
            stale = refresh or time.monotonic() - self._refreshed_at >= self.max_staleness
            if stale or (task not in self._entries and self.store.has_task(task)):
                self.refresh()
            entry = self._entries.get(task)
            if entry is None:
                raise TaskNotFound(task)
            if entry.record is None:
                raise NotRouted(f"task {task!r} has no routing row of the served inventory "
                                "(a plain LoRA, not ready, or another inventory)")
            ids, matrix = self._ids, self._matrix
            query = ids.index(task)
            scores = matrix @ matrix[query]
            if visible is not None:
                hidden = [i for i, other in enumerate(ids)
                          if (rec := self._entries[other].record) is None or not visible(rec)]
                scores[hidden] = -float("inf")
            shortlist = top_k(scores, max(k, self.shortlist), exclude=query)
            candidates = [(ids[i], self._entries[ids[i]].record) for i, score in shortlist if score != -float("inf")]
        try:
            exact_query = self._exact(entry.record)
        except Exception as err:  # the row the index holds has left the store (rewritten or deleted)
            raise _QueryGone(task) from err
        scored = []
        for other, record in candidates:
            try:
                scored.append((other, float(self._exact(record) @ exact_query)))  # type: ignore[arg-type]
            except Exception as err:  # noqa: BLE001 - rewritten or deleted since the refresh
                log.debug("task %r left out of a similar answer: %s", other, err)
        scored.sort(key=lambda pair: (-pair[1], pair[0]))
        return scored[:k]
