"""Re-scans for changes made elsewhere cost O(1) on a store with a change cursor: with nothing
changing, the per-task stamps are read at most twice after the cursor stops, whatever the count."""

from __future__ import annotations

from types import SimpleNamespace

from server.jobs.service import Registration


class CountingStore:
    def __init__(self, tasks: int) -> None:
        self.cursor = 1
        self.stamps = {f"t{i}": i for i in range(tasks)}
        self.stamp_reads = 0

    def change_cursor(self) -> int:
        return self.cursor

    def task_stamps(self) -> dict[str, int]:
        self.stamp_reads += 1
        return dict(self.stamps)


def _registration(store: CountingStore) -> tuple[Registration, list[str]]:
    forgotten: list[str] = []
    reg = Registration.__new__(Registration)  # only the change-propagation half is exercised
    reg.rt = SimpleNamespace(store=store)
    reg._versions, reg._cursor, reg._quiet = store.task_stamps(), None, 0
    reg._forget = forgotten.append
    store.stamp_reads = 0
    return reg, forgotten


def test_quiet_store_stops_reading_stamps_and_a_moved_cursor_finds_the_change():
    store = CountingStore(10_000)
    reg, forgotten = _registration(store)
    for _ in range(60):  # a minute of one-second re-scans with nothing changing
        reg._changed_elsewhere(None)
    assert store.stamp_reads == 2 and forgotten == []
    store.stamps["t42"] = -1
    store.cursor += 1
    reg._changed_elsewhere(None)
    assert forgotten == ["t42"]


def test_a_write_committed_after_the_cursor_was_read_is_still_found():
    """A writer takes its number before it commits: the first re-scan after the cursor moved may
    not see its row yet; the next one (cursor unchanged) must."""
    store = CountingStore(5)
    reg, forgotten = _registration(store)
    store.cursor += 1  # numbered, not yet committed: stamps unchanged
    reg._changed_elsewhere(None)
    assert forgotten == []
    store.stamps["t3"] = 99  # now committed, cursor where it was
    reg._changed_elsewhere(None)
    assert forgotten == ["t3"]
