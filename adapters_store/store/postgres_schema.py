"""The PostgreSQL store's schema and its migrations (`polyserve db upgrade`).

Each migration is a list of statements applied in one transaction, in order, once. `upgrade`
takes a transaction-level advisory lock first, so two processes upgrading at once run one after
the other and the second finds nothing to do; it is idempotent.
"""

from __future__ import annotations

import psycopg

# advisory lock key of schema changes (any fixed number no other lock of ours uses)
_SCHEMA_LOCK = 7300

MIGRATIONS: list[list[str]] = [
    [  # 1: the store contract's tables
        ("CREATE TABLE inventories (version text PRIMARY KEY, info jsonb NOT NULL, skills bytea NOT NULL, "
         "created_at timestamptz NOT NULL DEFAULT now())"),
        "CREATE TABLE store_meta (key text PRIMARY KEY, value text NOT NULL)",
        "CREATE SEQUENCE task_changes",
        ("CREATE TABLE tasks (id text PRIMARY KEY, record jsonb NOT NULL, weights bytea, "
         "stamp bigint NOT NULL DEFAULT nextval('task_changes'))"),
        "CREATE TABLE jobs (id text PRIMARY KEY, data jsonb NOT NULL)",
        "CREATE TABLE job_examples (id text PRIMARY KEY, examples jsonb NOT NULL)",
        "CREATE TABLE job_cancels (id text PRIMARY KEY, at timestamptz NOT NULL DEFAULT now())",
        # a delete advances the change sequence too, so one reading of it tells whether anything changed
        ("CREATE FUNCTION polyserve_task_deleted() RETURNS trigger LANGUAGE plpgsql AS "
         "$$ BEGIN PERFORM nextval('task_changes'); RETURN OLD; END $$"),
        "CREATE TRIGGER tasks_deleted AFTER DELETE ON tasks FOR EACH ROW EXECUTE FUNCTION polyserve_task_deleted()",
    ],
    [  # 2: the fleet's job queue (adapters_store.store.job_queue): claimed with FOR UPDATE SKIP LOCKED
        ("CREATE TABLE job_queue (id text PRIMARY KEY, enqueued_at timestamptz NOT NULL DEFAULT clock_timestamp(), "
         "owner text, token text, lease_until timestamptz, attempts int NOT NULL DEFAULT 0)"),
        "CREATE INDEX job_queue_order ON job_queue (enqueued_at, id)",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)


def current_version(conn: psycopg.Connection) -> int:
    exists = conn.execute("SELECT to_regclass('polyserve_schema') IS NOT NULL").fetchone()
    if not (exists and exists[0]):
        return 0
    row = conn.execute("SELECT max(version) FROM polyserve_schema").fetchone()
    return int(row[0] or 0) if row else 0


def upgrade(conn: psycopg.Connection) -> list[int]:
    """Apply the migrations this database lacks; returns their numbers (empty: up to date).
    Refuses a database whose schema is newer than this code."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS polyserve_schema (version int PRIMARY KEY, "
                     "applied_at timestamptz NOT NULL DEFAULT now())")
        have = current_version(conn)
        if have > SCHEMA_VERSION:
            raise RuntimeError(f"the database's schema is version {have}, newer than this polyserve's "
                               f"{SCHEMA_VERSION}: upgrade polyserve")
        applied = []
        for number in range(have + 1, SCHEMA_VERSION + 1):
            for statement in MIGRATIONS[number - 1]:
                conn.execute(statement.encode())  # fixed DDL of this module, never user input
            conn.execute("INSERT INTO polyserve_schema (version) VALUES (%s)", (number,))
            applied.append(number)
    return applied
