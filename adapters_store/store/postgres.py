"""The PostgreSQL store: the store contract (adapters_store.store.contract) in tables, for a fleet of
machines that share nothing but the database.

    polyserve_schema(version)                     the applied migrations (adapters_store.store.postgres_schema)
    inventories(version, info, skills)            content-addressed by the skills' digest, stored once
    store_meta('inventory' -> version)            the store's current inventory
    tasks(id, record, weights, stamp)             record = TaskRecord JSON; weights = its safetensors;
                                                  stamp = a number from one sequence, new on every write
    jobs(id, data), job_examples(id, examples), job_cancels(id)
    job_queue(id, enqueued_at, owner, token, lease_until, attempts)   jobs leased to workers

A task write is one statement in one transaction (record and weights in one row, so the commit
point is the row); deletes, settles and imports are one transaction each, serialised per task by
an advisory transaction lock. Every task change sends NOTIFY polyserve_tasks with the task id
(delivered at commit). Each node caches the inventory's skills under its own POLYSERVE_HOME
(`cache_dir`/<version>.safetensors), so a node that has only the DSN fetches them once.

Connection failures surface as StoreUnavailable (the server answers 503 `store_unavailable`).
While the database is down, calls fail at once instead of each waiting out the pool's timeout:
after a failure, one direct connection attempt at most every DOWN_PROBE_SECONDS decides whether
it is back (then the pool's dead connections are replaced); everything else fails fast meanwhile.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool, PoolTimeout

from adapters_store.store.atomic import atomic_write_bytes
from adapters_store.store.contract import AdapterStore, check_job_id, tensors_digest
from adapters_store.store.errors import StoreError, StoreUnavailable
from adapters_store.store.ids import validate_task_id
from adapters_store.store.location import is_dsn
from adapters_store.store.postgres_schema import upgrade
from adapters_store.store.records import InventoryInfo, TaskRecord

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "polyserve_tasks"
# advisory lock namespaces (the first of the two int4 keys): a decision about an id, a
# read-modify-write of one task, a running job's claim, installing an inventory into an empty store
_NS_DECIDE, _NS_TX, _NS_JOB, _NS_INSTALL = 7301, 7302, 7303, 7304
DOWN_PROBE_SECONDS = 0.5
POOL_FIRST_WAIT = 1.0


def redact(dsn: str) -> str:
    """The DSN without its password, for logs and errors."""
    return re.sub(r"(://[^:/@]+):[^@]*@", r"\1:***@", dsn)


class _ConnHold:
    """A job's claim: a session advisory lock on a connection of its own. The server ends the
    session (and the lock) when the process dies."""

    def __init__(self, conn: psycopg.Connection, key: str) -> None:
        self._conn, self._key = conn, key

    def release(self) -> None:
        if self._conn.closed:
            return
        try:
            self._conn.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (_NS_JOB, self._key))
        except psycopg.Error:
            pass  # the session is gone, and its lock with it
        finally:
            self._conn.close()

    def still_held(self) -> bool:
        return not self._conn.closed


class PostgresStore(AdapterStore):
    def __init__(self, dsn: str, *, cache_dir: str | Path | None = None, pool_size: int = 8,
                 connect_timeout: float = 5.0, migrate: bool = True) -> None:
        if not is_dsn(dsn):
            raise ValueError(f"not a PostgreSQL DSN: {redact(str(dsn))!r}")
        self.dsn = dsn
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.connect_timeout = connect_timeout
        self._local = threading.local()
        self._down_until: float | None = None  # the database failed: fail fast until then, then probe
        self._probe_lock = threading.Lock()
        self._pool_size = pool_size
        self._pool = self._new_pool()
        try:
            self._pool.open(wait=True, timeout=connect_timeout)
        except PoolTimeout as err:
            self._pool.close()
            raise StoreUnavailable(f"PostgreSQL store {self.location} is unreachable") from err
        if migrate:
            with self._conn() as conn:
                upgrade(conn)

    def _new_pool(self) -> ConnectionPool:
        return ConnectionPool(
            self.dsn, min_size=1, max_size=self._pool_size, open=False, timeout=self.connect_timeout,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(self.connect_timeout))},
            check=ConnectionPool.check_connection, name="polyserve-store",
        )

    @property
    def location(self) -> str:
        return redact(self.dsn)

    def close(self) -> None:
        self._pool.close()

    # -- connections ------------------------------------------------------------------------
    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection]:
        """The thread's connection inside a transaction or task_lock, else one from the pool."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            try:
                yield held
            except psycopg.OperationalError as err:  # its session ended (a restart, a terminated backend)
                raise StoreUnavailable(f"PostgreSQL store {self.location}: {err}") from err
            return
        self._check_up()
        try:
            with self._pooled() as conn:
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as err:
            raise StoreUnavailable(f"PostgreSQL store {self.location}: {err}") from err

    @contextmanager
    def _pooled(self) -> Iterator[psycopg.Connection]:
        """A pooled connection. No connection within POOL_FIRST_WAIT: the outage is found out by
        one direct attempt (refused: OperationalError at once) rather than by waiting out the
        pool's whole timeout; if the database answers, the pool was only busy: wait on."""
        pool = self._pool
        try:
            conn = pool.getconn(timeout=min(POOL_FIRST_WAIT, self.connect_timeout))
        except PoolTimeout:
            try:
                psycopg.connect(self.dsn, connect_timeout=max(1, int(self.connect_timeout))).close()
                conn = pool.getconn(timeout=self.connect_timeout)
            except (psycopg.OperationalError, PoolTimeout):
                self._mark_down()
                raise
        try:
            yield conn
        finally:
            if conn.broken:  # the session was lost (a statement's own error leaves it usable)
                self._mark_down()
            pool.putconn(conn)

    def _mark_down(self) -> None:
        self._down_until = time.monotonic() + DOWN_PROBE_SECONDS

    def _check_up(self) -> None:
        """After a failure: StoreUnavailable at once, except for one caller every
        DOWN_PROBE_SECONDS, who tries one direct connection (refused: at once; a silent host:
        the connect timeout). Back: the pool replaces its dead connections and calls go on."""
        until = self._down_until
        if until is None:
            return
        if time.monotonic() < until or not self._probe_lock.acquire(blocking=False):
            raise StoreUnavailable(f"PostgreSQL store {self.location} is unreachable (retrying)")
        try:
            self._down_until = time.monotonic() + DOWN_PROBE_SECONDS  # the others fail fast meanwhile
            try:
                psycopg.connect(self.dsn, connect_timeout=max(1, int(self.connect_timeout))).close()
            except psycopg.Error as err:
                self._mark_down()
                raise StoreUnavailable(f"PostgreSQL store {self.location}: {err}") from err
            # a fresh pool: the old one's connections are dead and its reconnection attempts are
            # in a backoff that grew with the outage (1, 2, 4 ... s); lent ones close when returned
            fresh = self._new_pool()
            fresh.open(wait=False)
            old, self._pool = self._pool, fresh
            old.close(timeout=0)
            self._down_until = None
            log.info("PostgreSQL store %s is reachable again", self.location)
        finally:
            self._probe_lock.release()

    @contextmanager
    def _bound(self) -> Iterator[psycopg.Connection]:
        """Bind one pooled connection to this thread for a block (nested blocks reuse it)."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            yield held
            return
        with self._conn() as conn:
            self._local.conn = conn
            try:
                yield conn
            finally:
                self._local.conn = None

    @contextmanager
    def _transaction(self, task: str | None = None) -> Iterator[None]:
        with self._bound() as conn:
            try:
                with conn.transaction():
                    if task is not None:
                        conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_NS_TX, task))
                    yield
            except psycopg.OperationalError as err:
                raise StoreUnavailable(f"PostgreSQL store {self.location}: {err}") from err

    @contextmanager
    def task_lock(self, task: str) -> Iterator[None]:
        """A session advisory lock on the id, on the connection this thread then uses for every
        store call inside the block."""
        validate_task_id(task)
        with self._bound() as conn:
            conn.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (_NS_DECIDE, task))
            try:
                yield
            finally:
                if not conn.closed:
                    conn.execute("SELECT pg_advisory_unlock(%s, hashtext(%s))", (_NS_DECIDE, task))

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        with self._conn() as conn:
            row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._conn() as conn:
            return conn.execute(sql, params).fetchall()

    # -- inventory --------------------------------------------------------------------------
    def _read_inventory_json(self) -> dict[str, Any] | None:
        return self._one("SELECT i.info FROM store_meta m JOIN inventories i ON i.version = m.value "
                         "WHERE m.key = 'inventory'")

    def _read_skills_bytes(self, info: InventoryInfo) -> bytes:
        cached = self.cache_dir / f"{info.version}.safetensors" if self.cache_dir is not None else None
        if cached is not None and cached.is_file():
            blob = cached.read_bytes()
            from safetensors.torch import load as st_load

            if tensors_digest(st_load(blob))[:12] == info.version:
                return blob
            log.warning("cached skills %s do not match their version; fetching them again", cached)
        blob = self._one("SELECT skills FROM inventories WHERE version = %s", (info.version,))
        if blob is None:
            raise StoreError(f"inventory {info.version} has no skills in {self.location}")
        blob = bytes(blob)
        if cached is not None:
            atomic_write_bytes(cached, blob)
        return blob

    def _write_inventory(self, info: InventoryInfo, skills: bytes) -> None:
        with self._transaction(None), self._conn() as conn:
            conn.execute("INSERT INTO inventories (version, info, skills) VALUES (%s, %s, %s) "
                         "ON CONFLICT (version) DO NOTHING", (info.version, Jsonb(info.to_json()), skills))
            conn.execute("INSERT INTO store_meta (key, value) VALUES ('inventory', %s) "
                         "ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value", (info.version,))

    @contextmanager
    def _install_lock(self) -> Iterator[None]:
        with self._bound() as conn:
            conn.execute("SELECT pg_advisory_lock(%s, 0)", (_NS_INSTALL,))
            try:
                yield
            finally:
                if not conn.closed:
                    conn.execute("SELECT pg_advisory_unlock(%s, 0)", (_NS_INSTALL,))

    # -- tasks ----------------------------------------------------------------------------
    def _read_record(self, task: str) -> dict[str, Any] | None:
        return self._one("SELECT record FROM tasks WHERE id = %s", (task,))

    def _record_dicts(self) -> Iterator[dict[str, Any]]:
        for (record,) in self._all("SELECT record FROM tasks ORDER BY id"):
            yield record

    def _read_records(self, tasks: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        """One query for them all; the record column only (weights stay in the table)."""
        yield from self._all("SELECT id, record FROM tasks WHERE id = ANY(%s)", (tasks,))

    def _read_blob(self, record: TaskRecord) -> bytes:
        blob = self._one("SELECT weights FROM tasks WHERE id = %s AND record->>'file' = %s", (record.id, record.file))
        if blob is None:
            raise StoreError(f"task {record.id!r} was rewritten or deleted while being read")
        return bytes(blob)

    def _commit_task(self, record: TaskRecord, blob: bytes | None, previous: TaskRecord | None) -> None:
        keep = blob is None and record.file is not None and previous is not None and previous.file == record.file
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO tasks (id, record, weights) VALUES (%(id)s, %(record)s, %(weights)s) "
                "ON CONFLICT (id) DO UPDATE SET record = EXCLUDED.record, "
                "weights = CASE WHEN %(keep)s THEN tasks.weights ELSE EXCLUDED.weights END, "
                "stamp = nextval('task_changes')",
                {"id": record.id, "record": Jsonb(record.to_json()), "weights": blob, "keep": keep})
            conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, record.id))

    def _remove_task(self, task: str) -> None:
        with self._conn() as conn:
            conn.execute("DELETE FROM tasks WHERE id = %s", (task,))
            conn.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, task))

    def task_stamps(self) -> dict[str, Any]:
        """{task id: its row's change stamp}: two small columns, no record is read."""
        return dict(self._all("SELECT id, stamp FROM tasks"))

    def change_cursor(self) -> int:
        """The newest change stamp handed out: compare two readings to know whether any task
        changed, in one cheap query whatever the number of tasks (deletes advance it too)."""
        return int(self._one("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM task_changes") or 0)

    def subscribe(self, on_change: Callable[[str | None], None]) -> Callable[[], None]:
        """LISTEN polyserve_tasks on a connection of its own, in a thread. After a reconnect it
        calls on_change(None): notifications sent while it was away are lost, a re-scan is not."""
        stop = threading.Event()

        def listen() -> None:
            first = True
            while not stop.is_set():
                try:
                    with psycopg.connect(self.dsn, autocommit=True,
                                         connect_timeout=max(1, int(self.connect_timeout))) as conn:
                        conn.execute("LISTEN polyserve_tasks")  # NOTIFY_CHANNEL
                        if not first:
                            on_change(None)
                        first = False
                        while not stop.is_set():
                            for note in conn.notifies(timeout=0.5):
                                on_change(note.payload)
                except psycopg.Error as err:
                    log.warning("task change listener lost %s (%s); reconnecting", self.location, err)
                    first = False
                    stop.wait(1.0)
                except Exception:  # keep listening whatever a callback raised
                    log.exception("task change listener failed; restarting it")
                    stop.wait(1.0)

        thread = threading.Thread(target=listen, name="polyserve-store-listen", daemon=True)
        thread.start()

        def close() -> None:
            stop.set()
            thread.join(timeout=2)

        return close

    def shared_secret(self, name: str) -> bytes:
        """Kept in store_meta under 'secret:<name>'; the first node's insert wins."""
        key = f"secret:{name}"
        with self._conn() as conn:
            conn.execute("INSERT INTO store_meta (key, value) VALUES (%s, %s) ON CONFLICT (key) DO NOTHING",
                         (key, secrets.token_hex(32)))
            row = conn.execute("SELECT value FROM store_meta WHERE key = %s", (key,)).fetchone()
        if row is None:
            raise StoreError(f"no {name} in {self.location} right after writing it")
        return bytes.fromhex(row[0])

    # -- jobs -----------------------------------------------------------------------------
    def _write_job(self, job: dict[str, Any]) -> None:
        with self._conn() as conn:
            conn.execute("INSERT INTO jobs (id, data) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE SET data = "
                         "EXCLUDED.data", (job["id"], Jsonb(job)))

    def _write_job_if_held(self, job: dict[str, Any], token: str) -> bool:
        # FOR SHARE on the queue row: a claim (UPDATE, FOR UPDATE SKIP LOCKED) either committed first,
        # and the row re-checked after it no longer has this token, or it skips the row until the
        # write commits
        with self._conn() as conn:
            row = conn.execute(
                "WITH held AS (SELECT id FROM job_queue WHERE id = %(id)s AND token = %(token)s FOR SHARE) "
                "INSERT INTO jobs (id, data) SELECT id, %(data)s FROM held "
                "ON CONFLICT (id) DO UPDATE SET data = EXCLUDED.data RETURNING id",
                {"id": job["id"], "token": token, "data": Jsonb(job)}).fetchone()
        return row is not None

    def _read_job(self, job_id: str) -> dict[str, Any] | None:
        return self._one("SELECT data FROM jobs WHERE id = %s", (job_id,))

    def _job_dicts(self) -> list[dict[str, Any]]:
        return [data for (data,) in self._all("SELECT data FROM jobs ORDER BY id")]

    def _write_examples(self, job_id: str, examples: list[dict[str, str]]) -> None:
        with self._conn() as conn:
            conn.execute("INSERT INTO job_examples (id, examples) VALUES (%s, %s) ON CONFLICT (id) DO UPDATE "
                         "SET examples = EXCLUDED.examples", (job_id, Jsonb(examples)))

    def _read_examples(self, job_id: str) -> list[dict[str, str]] | None:
        return self._one("SELECT examples FROM job_examples WHERE id = %s", (job_id,))

    def _mark_cancel(self, job_id: str) -> None:
        with self._conn() as conn:
            conn.execute("INSERT INTO job_cancels (id) VALUES (%s) ON CONFLICT (id) DO NOTHING", (job_id,))

    def _cancel_marked(self, job_id: str) -> bool:
        return self._one("SELECT true FROM job_cancels WHERE id = %s", (job_id,)) is not None

    def _delete_job(self, job_id: str) -> None:
        with self._transaction(None), self._conn() as conn:
            for table in ("job_examples", "job_cancels", "job_queue", "jobs"):
                conn.execute(f"DELETE FROM {table} WHERE id = %s", (job_id,))

    # -- the job queue: one statement each; a claim skips rows another claim has locked ----------
    def _queue_add(self, job_id: str) -> None:
        with self._conn() as conn:
            conn.execute("INSERT INTO job_queue (id) VALUES (%s) ON CONFLICT (id) DO NOTHING", (job_id,))

    def _queue_claim(self, owner: str, token: str, lease_seconds: float,
                     job_id: str | None = None) -> tuple[str, int] | None:
        with self._conn() as conn:
            row = conn.execute(
                "UPDATE job_queue q SET owner = %(owner)s, token = %(token)s, attempts = q.attempts + 1, "
                "lease_until = clock_timestamp() + make_interval(secs => %(lease)s) "
                "FROM (SELECT id FROM job_queue WHERE (lease_until IS NULL OR lease_until < clock_timestamp()) "
                "AND (%(job)s::text IS NULL OR id = %(job)s) "
                "ORDER BY enqueued_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) c "
                "WHERE q.id = c.id RETURNING q.id, q.attempts",
                {"owner": owner, "token": token, "lease": float(lease_seconds), "job": job_id}).fetchone()
        return None if row is None else (row[0], int(row[1]))

    def _queue_renew(self, job_id: str, token: str, lease_seconds: float) -> bool:
        with self._conn() as conn:
            cur = conn.execute("UPDATE job_queue SET lease_until = clock_timestamp() + make_interval(secs => %s) "
                               "WHERE id = %s AND token = %s", (float(lease_seconds), job_id, token))
            return cur.rowcount == 1

    def _queue_holds(self, job_id: str, token: str) -> bool:
        return self._one("SELECT true FROM job_queue WHERE id = %s AND token = %s", (job_id, token)) is not None

    def _queue_remove(self, job_id: str, token: str | None) -> None:
        with self._conn() as conn:
            conn.execute("DELETE FROM job_queue WHERE id = %s AND (%s::text IS NULL OR token = %s)",
                         (job_id, token, token))

    def _queue_has(self, job_id: str) -> bool:
        return self._one("SELECT true FROM job_queue WHERE id = %s", (job_id,)) is not None

    def _queue_size(self) -> int:
        return int(self._one("SELECT count(*) FROM job_queue", ()))

    def _queue_size_of(self, tenant: str) -> int:
        return int(self._one("SELECT count(*) FROM job_queue q JOIN jobs j ON j.id = q.id "
                             "WHERE j.data->>'tenant' = %s", (tenant,)))

    def hold_job(self, job_id: str) -> _ConnHold | None:
        check_job_id(job_id)
        try:
            conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self.connect_timeout)))
        except psycopg.OperationalError as err:
            raise StoreUnavailable(f"PostgreSQL store {self.location}: {err}") from err
        got = conn.execute("SELECT pg_try_advisory_lock(%s, hashtext(%s))", (_NS_JOB, job_id)).fetchone()
        if not (got and got[0]):
            conn.close()
            return None
        return _ConnHold(conn, job_id)
