"""The in-memory task list that listings read (adapters_store/store/snapshot.py), on both backends:
it follows changes made through another connection or process at once, a quiet store costs no
record read, a change re-reads only the changed task, a write that commits after its number was
seen is still found, and a listing never reads weights."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from adapters_store.store import open_store
from adapters_store.store.contract import AdapterStore
from adapters_store.store.snapshot import SETTLE_SECONDS, TaskSnapshot
from server.registry.tasks import TaskRegistry
from tests.support.pg_utils import temp_database
from tests.support.server_fixtures import build_store, put_task

ROOT = Path(__file__).resolve().parents[3]
TASKS = tuple(f"t{i:02d}" for i in range(20))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["directory", "postgresql"])
def location(request, tmp_path) -> Iterator[str]:
    """A store holding TASKS: a directory, or a fresh database filled from one."""
    src = build_store(tmp_path / "dir", tasks=TASKS)
    if request.param == "directory":
        yield str(src.root)
        return
    with temp_database() as dsn:
        pg = open_store(dsn)
        info, skills = src.inventory_bytes()
        pg.import_inventory(info, skills)
        for record in src.list_tasks():
            pg.import_task(record, src.weights_bytes(record))
        pg.close()  # type: ignore[attr-defined]
        yield dsn


def _open(location: str) -> AdapterStore:
    return open_store(location)


def _close(*stores: AdapterStore) -> None:
    for store in stores:
        close = getattr(store, "close", None)
        if close:
            close()


def _ids(records) -> list[str]:
    return [r.id for r in records]


def test_listing_follows_changes_made_through_another_connection_at_once(location):
    """Without the cursor check (or, on the directory store, the stamp comparison) the reader
    would list what it loaded first."""
    reader, writer = _open(location), _open(location)
    try:
        registry = TaskRegistry(reader, cache=None)
        assert _ids(registry.list()) == list(TASKS)
        put_task(writer, "new-one", seed=1)
        assert "new-one" in _ids(registry.list())
        put_task(writer, "t03", seed=2)  # a new version
        assert {r.id: r.version for r in registry.list()}["t03"] == 2
        writer.delete_task("t05")
        assert "t05" not in _ids(registry.list())
        assert registry.list() == writer.list_tasks()  # the same records the store lists
    finally:
        _close(reader, writer)


WRITER = r"""
import sys
from adapters_store.store import open_store
from tests.support.server_fixtures import put_task
store = open_store(sys.argv[1])
put_task(store, "from-elsewhere", seed=3)
store.delete_task("t07")
"""


def test_listing_follows_a_change_made_by_another_process(location):
    reader = _open(location)
    try:
        registry = TaskRegistry(reader, cache=None)
        assert "t07" in _ids(registry.list())
        out = subprocess.run([sys.executable, "-c", WRITER, location], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        listed = _ids(registry.list())
        assert "from-elsewhere" in listed and "t07" not in listed
    finally:
        _close(reader)


def test_a_quiet_store_costs_no_record_read_and_a_change_rereads_only_that_task(location):
    """Reading every record per listing (the old way) would make records_read grow by the task
    count at each listing."""
    store, writer = _open(location), _open(location)
    clock = Clock()
    try:
        snap = TaskSnapshot(store, clock=clock)
        assert len(snap.records()) == len(TASKS) and snap.records_read == len(TASKS)
        clock.now += SETTLE_SECONDS + 0.1
        for _ in range(5):
            assert len(snap.records()) == len(TASKS)
        assert snap.records_read == len(TASKS)
        if store.change_cursor() is not None:  # PostgreSQL: once settled, not even the stamps are read
            settled = snap.comparisons
            snap.records()
            assert snap.comparisons == settled
        put_task(writer, "t11", seed=9)
        assert {r.id: r.version for r in snap.records()}["t11"] == 2
        assert snap.records_read == len(TASKS) + 1
    finally:
        _close(store, writer)


def _insert_uncommitted(dsn: str, task: str, like: str) -> psycopg.Connection:
    """A writer that has taken its change number (the row's stamp) but not committed yet."""
    conn = psycopg.connect(dsn)
    record = conn.execute("SELECT record FROM tasks WHERE id = %s", (like,)).fetchone()[0]
    conn.execute("INSERT INTO tasks (id, record) VALUES (%s, %s)", (task, json.dumps({**record, "id": task})))
    return conn


def test_a_late_commit_is_found_within_the_settle_window_and_after_it_through_mark(tmp_path):
    """The cursor moves when a writer takes its number, before its row is visible: the listing
    that saw the move must not take itself for settled (else `late` stays unlisted), and a commit
    later than the settle window is brought in by the NOTIFY's mark."""
    src = build_store(tmp_path / "dir", tasks=("t00", "t01"))
    with temp_database() as dsn:
        store = open_store(dsn)
        info, skills = src.inventory_bytes()
        store.import_inventory(info, skills)
        for record in src.list_tasks():
            store.import_task(record, src.weights_bytes(record))
        clock = Clock()
        snap = TaskSnapshot(store, clock=clock)
        try:
            assert _ids(snap.records()) == ["t00", "t01"]
            clock.now += SETTLE_SECONDS + 0.1
            snap.records()  # settled
            # 1. committed within the settle window: a later listing compares again and finds it
            writer = _insert_uncommitted(dsn, "late", like="t00")
            assert _ids(snap.records()) == ["t00", "t01"]  # numbered, not visible yet
            writer.commit()
            writer.close()
            assert "late" in _ids(snap.records())
            # 2. committed after the window closed: only the NOTIFY (-> mark) can bring it in
            clock.now += SETTLE_SECONDS + 0.1
            snap.records()
            writer = _insert_uncommitted(dsn, "later", like="t00")
            snap.records()
            clock.now += SETTLE_SECONDS + 0.1
            snap.records()  # settles while `later` is still uncommitted
            writer.commit()
            writer.close()
            assert "later" not in _ids(snap.records())
            snap.mark("later")
            assert "later" in _ids(snap.records())
        finally:
            _close(store)


def test_a_listing_never_reads_weights(location, monkeypatch):
    store = _open(location)
    statements: list[str] = []
    real_execute = psycopg.Connection.execute

    def spy(self, query, *args, **kwargs):
        statements.append(query if isinstance(query, str) else str(query))
        return real_execute(self, query, *args, **kwargs)

    def no_weights(*_args, **_kwargs):
        raise AssertionError("a listing read a task's weights")

    monkeypatch.setattr(psycopg.Connection, "execute", spy)
    monkeypatch.setattr(type(store), "_read_blob", no_weights)
    try:
        records = TaskSnapshot(store).records()
        assert _ids(records) == list(TASKS) and all(r.file for r in records)
        for sql in statements:
            assert "weights" not in sql and "*" not in sql, sql
    finally:
        _close(store)


class FailingOnce:
    """A store whose next read fails (a database outage), then recovers."""

    def __init__(self, store: AdapterStore, where: str) -> None:
        self.store, self.where, self.fail = store, where, False

    def __getattr__(self, name: str):
        attr = getattr(self.store, name)
        if name == self.where and self.fail:
            self.fail = False

            def down(*_args, **_kwargs):
                from adapters_store.store.errors import StoreUnavailable

                raise StoreUnavailable("down")

            return down
        return attr


@pytest.mark.parametrize("where", ["change_cursor", "task_stamps"])
def test_a_mark_taken_while_the_store_is_down_is_not_lost(location, where):
    store, writer = _open(location), _open(location)
    clock = Clock()
    try:
        flaky = FailingOnce(store, where)
        snap = TaskSnapshot(flaky, clock=clock)  # type: ignore[arg-type]
        snap.records()
        clock.now += SETTLE_SECONDS + 0.1
        snap.records()
        snap.mark("t02")
        flaky.fail = True
        with pytest.raises(Exception, match="down"):
            snap.records()
        before = snap.records_read
        snap.records()  # the store is back: the mark was kept, so t02 is re-read
        assert snap.records_read == before + 1
    finally:
        _close(store, writer)
