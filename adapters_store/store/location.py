"""What a store location names: a PostgreSQL DSN (the fleet store) or a directory (the embedded
default). Kept apart from opening one (adapters_store.store.open_store), so that the settings and
the PostgreSQL backend can ask without importing either backend."""

from __future__ import annotations

from pathlib import Path


def is_dsn(location: str | Path) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))
