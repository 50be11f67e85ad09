"""A fleet of separate processes on one PostgreSQL database: serving replicas (POLYSERVE_JOBS=off)
and `polyserve worker`s, each with its own POLYSERVE_HOME (no shared directory), the tiny backbone
and a short job lease. Each process names its PostgreSQL sessions (PGAPPNAME) so a test can find
its locks or end its connections."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psycopg

from adapters_store.store import open_store
from adapters_store.store.copy import copy_store
from tests.support.server_fixtures import build_store, free_port

REPO = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 3.0
EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(12)]
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass
class FleetProcess:
    name: str
    popen: subprocess.Popen
    url: str
    log: Path

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not ready: {self.tail()}")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(20)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()


def seed_database(dsn: str, tmp: Path) -> None:
    """The tiny test inventory and its tasks, copied into the fleet's database."""
    src = build_store(tmp / "seed")
    dst = open_store(dsn)
    copy_store(src, dst)
    dst.close()  # type: ignore[attr-defined]


def start(kind: str, name: str, dsn: str, tmp: Path, *, backbone: str = "tiny",
          env: dict[str, str] | None = None) -> FleetProcess:
    """kind: "serve" (a replica with POLYSERVE_JOBS=off) or "worker"; its own POLYSERVE_HOME."""
    home = tmp / f"home-{name}"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    full = {**os.environ, "POLYSERVE_HOME": str(home), "POLYSERVE_STORE": dsn, "POLYSERVE_BACKBONE": backbone,
            "POLYSERVE_JOBS": "off", "POLYSERVE_JOB_LEASE_SECONDS": str(LEASE_SECONDS), "POLYSERVE_THREADS": "1",
            "POLYSERVE_JOB_POLL_SECONDS": "0.1", "PGAPPNAME": f"fleet-{name}", "PYTHONPATH": str(REPO),
            **(env or {})}
    full.pop("POLYSERVE_REDIS_URL", None)
    log = tmp / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen([sys.executable, "-m", "server.cli", kind, "--port", str(port)], env=full, cwd=REPO,
                                 stdout=out, stderr=subprocess.STDOUT)
    return FleetProcess(name, popen, f"http://127.0.0.1:{port}", log)


def wait_job(client: httpx.Client, job_id: str, timeout: float = 60, until: tuple[str, ...] = TERMINAL) -> dict:
    deadline = time.time() + timeout
    job: dict = {}
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job.get("status") in until:
            return job
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} still {job.get('status')} after {timeout} s")


def queue_row(dsn: str, job_id: str) -> tuple | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT owner, attempts FROM job_queue WHERE id = %s", (job_id,)).fetchone()


def waiting_on_advisory_lock(dsn: str, app: str) -> bool:
    """Whether a session of process `app` (its PGAPPNAME) waits for an advisory lock."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
                           "WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name = %s",
                           (app,)).fetchone()
    return bool(row and row[0])
