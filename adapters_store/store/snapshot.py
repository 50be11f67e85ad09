"""Every task's record held in memory and kept current cheaply: what listings read.

A listing (`GET /v1/models`, `GET /v1/tasks`) used to read and parse every record per request:
with 10,000 tasks on PostgreSQL that was ~0.3 s on a quiet host. The snapshot keeps the parsed
records with each one's change stamp and re-reads only the records whose stamp changed:

    records():  cursor = store.change_cursor()            one O(1) read (PostgreSQL's sequence)
                if the cursor moved, or has not settled,   stamps = store.task_stamps()
                or a task was marked:                      (ids and stamps, no record is read)
                                                           re-read only new / changed / marked ids
                return the sorted list held               (a quiet store: no record read at all)
    mark(task): a change pushed by LISTEN/NOTIFY, Redis or a re-scan (TaskRegistry.forget):
                the stamps are compared and `task` re-read at the next listing

A writer takes its stamp before it commits, so the cursor can move before its row is visible.
After the cursor moves, the stamps are compared at every listing until one comparison starts
SETTLE_SECONDS after the last move; a NOTIFY, sent at commit, marks the task as well. A store with
no cursor (the directory store) compares stamps at every listing: a stat per task instead of
reading and parsing every task.json. Stamps are read before the records they let through, so a
record is never older than its stamp: a change made in between is re-read next time, not missed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from adapters_store.store.records import TaskRecord

if TYPE_CHECKING:
    from adapters_store.store.contract import AdapterStore

SETTLE_SECONDS = 1.0
_ABSENT = object()


class TaskSnapshot:
    def __init__(self, store: AdapterStore, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._clock = clock
        self._lock = threading.Lock()  # one refresh at a time; listings wait for it
        self._marked: set[str] = set()
        self._marked_lock = threading.Lock()  # mark() never waits for a refresh
        self._stamps: dict[str, Any] = {}
        self._records: dict[str, TaskRecord] = {}
        self._sorted: list[TaskRecord] = []
        self._cursor: int | None = None
        self._moved_at = 0.0
        self._settled = False  # a comparison started SETTLE_SECONDS after the cursor last moved
        self.records_read = 0  # records read from the store so far (tests, logs)
        self.comparisons = 0  # stamp comparisons so far

    def mark(self, task: str) -> None:
        """`task` changed (a notification): compare stamps and re-read it at the next listing."""
        with self._marked_lock:
            self._marked.add(task)

    def records(self) -> list[TaskRecord]:
        """Every readable task's record, in id order (the list is shared: do not change it).
        Raises what the store raises when it cannot be read (StoreUnavailable -> 503)."""
        with self._lock:
            cursor = self.store.change_cursor()
            now = self._clock()
            with self._marked_lock:
                marked, self._marked = self._marked, set()
            if cursor is None or cursor != self._cursor:
                self._cursor, self._moved_at, self._settled = cursor, now, False
            if marked or not self._settled:
                try:
                    self._compare(marked)
                except BaseException:
                    with self._marked_lock:
                        self._marked |= marked  # not lost: taken again by the next listing
                    raise
            return self._sorted

    def _compare(self, marked: set[str]) -> None:
        started = self._clock()
        stamps = self.store.task_stamps()
        self.comparisons += 1
        changed = {t for t, s in stamps.items() if self._stamps.get(t, _ABSENT) != s} | (marked & stamps.keys())
        gone = self._stamps.keys() - stamps.keys()
        fresh = self.store.get_tasks(sorted(changed)) if changed else {}
        self.records_read += len(fresh)
        for task in gone:
            del self._stamps[task]
            self._records.pop(task, None)
        for task in changed:
            self._stamps[task] = stamps[task]
            if task in fresh:
                self._records[task] = fresh[task]
            else:  # deleted since the stamps were read, or unreadable: absent until it changes
                self._records.pop(task, None)
        if changed or gone:
            self._sorted = [self._records[t] for t in sorted(self._records)]
        # the first comparison that began SETTLE_SECONDS after the last move saw every write
        # numbered before it; until then every listing compares again
        self._settled = self._cursor is not None and started - self._moved_at >= SETTLE_SECONDS
