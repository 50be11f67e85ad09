"""A throwaway PostgreSQL server of the test's own, to stop and restart at will: fault tests must
not touch the shared one at 127.0.0.1:5432 that other tests use.

    def test_x(pg_instance):            # import the fixture: from tests.support.pg_instance import pg_instance
        dsn = pg_instance.create_database("polyserve")
        pg_instance.stop()               # every session ends, as in a restart; "immediate" = a crash
        pg_instance.start()              # same data, same port

initdb runs into a fresh directory under /tmp, the server listens on 127.0.0.1 at a free port and
its Unix socket in that directory. PostgreSQL refuses to run as root: as root, every binary runs
as the `postgres` user (runuser) and the directory is handed to it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from tests.support.server_fixtures import free_port

PG_BIN = Path(os.environ.get("POLYSERVE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class PgInstance:
    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.data = root / "data"
        self.log = root / "server.log"
        self.port = port

    def _run(self, binary: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(PG_BIN / binary), *args]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{binary} {' '.join(args)} failed ({out.returncode}): {out.stderr[-2000:]}"
                               f"\n{self.server_log()}")
        return out

    def server_log(self) -> str:
        try:
            return self.log.read_text()[-2000:]
        except OSError:
            return ""

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c max_connections=100")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        """`fast`: every session is ended and the server shuts down cleanly; `immediate`: as a crash."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def running(self) -> bool:
        try:
            psycopg.connect(self.dsn(), connect_timeout=2).close()
        except psycopg.OperationalError:
            return False
        return True

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as admin:
            admin.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)


@contextmanager
def own_postgres() -> Iterator[PgInstance]:
    """A fresh PostgreSQL server, running; stopped and its directory removed afterwards."""
    if not (PG_BIN / "initdb").is_file():
        raise RuntimeError(f"no PostgreSQL binaries in {PG_BIN} (set POLYSERVE_TEST_PG_BIN)")
    root = Path(tempfile.mkdtemp(prefix="polyserve-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
    instance = PgInstance(root, free_port())
    try:
        instance.init()
        instance.start()
        yield instance
    finally:
        if (instance.data / "postmaster.pid").exists():
            try:
                instance.stop("immediate")
            except (RuntimeError, subprocess.TimeoutExpired):
                pass  # already stopped, or stopping anyway: the directory goes regardless
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def pg_instance() -> Iterator[PgInstance]:
    with own_postgres() as instance:
        yield instance
