"""A throwaway PostgreSQL database per test, on the real server at 127.0.0.1:5432.

Tests never skip for want of PostgreSQL: `.ci/run` starts it, and a store test that cannot reach
it fails with the reason."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

ADMIN_DSN = os.environ.get("POLYSERVE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _dsn_for(database: str) -> str:
    return ADMIN_DSN.rsplit("/", 1)[0] + "/" + database


@contextmanager
def temp_database(prefix: str = "polyserve_test") -> Iterator[str]:
    """Create a fresh database, yield its DSN, drop it (ending its sessions) afterwards."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    try:
        admin = psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as err:
        raise RuntimeError(f"PostgreSQL is not reachable at {ADMIN_DSN} (.ci/run starts it): {err}") from err
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _dsn_for(name)
    finally:
        with psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
