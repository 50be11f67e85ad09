"""Open the store a location names: a PostgreSQL DSN (the fleet store) or a directory (the
embedded default)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and safetensors load only when a store is opened (Settings imports is_dsn)
    from adapters_store.store.contract import AdapterStore


def is_dsn(location: str | Path) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def open_store(location: str | Path, *, cache_dir: str | Path | None = None) -> AdapterStore:
    """`cache_dir`: where a PostgreSQL store keeps this node's copy of the inventory's skills
    (normally $POLYSERVE_HOME/inventories); unused by a directory store."""
    if is_dsn(location):
        from adapters_store.store.postgres import PostgresStore  # psycopg only where a DSN is used

        return PostgresStore(str(location), cache_dir=cache_dir)
    from adapters_store.store.directory import DirectoryStore

    return DirectoryStore(Path(location).expanduser())
