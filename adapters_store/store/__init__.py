"""The store: one skill inventory, per-task routing rows or LoRAs, the task registry and jobs.

    contract.py         AdapterStore: what every backend keeps and how it changes, written once
    directory.py        DirectoryStore: a directory of safetensors + JSON (the embedded default)
    postgres.py         PostgresStore: the same contract in tables, for a fleet
                        (postgres_schema.py: its schema and migrations)
    location.py         which backend a location names (is_dsn)
    records.py, ids.py, errors.py, atomic.py, job_queue.py, snapshot.py: what both share
    materialize.py      a stored task -> its plain per-layer LoRA
    copy.py, refine.py  a store copied to another backend; one with refined routing heads

`open_store(location)` opens the backend a location names.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from adapters_store.store.location import is_dsn

if TYPE_CHECKING:  # torch and safetensors load only when a store is opened
    from adapters_store.store.contract import AdapterStore


def open_store(location: str | Path, *, cache_dir: str | Path | None = None) -> AdapterStore:
    """`cache_dir`: where a PostgreSQL store keeps this node's copy of the inventory's skills
    (normally $POLYSERVE_HOME/inventories); unused by a directory store."""
    if is_dsn(location):
        from adapters_store.store.postgres import PostgresStore  # psycopg only where a DSN is used

        return PostgresStore(str(location), cache_dir=cache_dir)
    from adapters_store.store.directory import DirectoryStore

    return DirectoryStore(Path(location).expanduser())
