"""The PostgreSQL store's own behaviour on the real server: migrations under concurrency, installing
the default inventory once, `store copy`, a node that has only the DSN, and the database going
away under a running server (503 store_unavailable, then recovery by itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import psycopg
import pytest
import torch

from adapters_store.store import open_store
from adapters_store.store.errors import StoreError
from adapters_store.store.postgres_schema import SCHEMA_VERSION
from tests.server.jobs.test_registration_api import serve_process, wait_process_ready
from tests.support.pg_utils import ADMIN_DSN, temp_database
from tests.support.server_fixtures import (
    TASKS,
    build_store,
    free_port,
    live_server,
    settings_for,
    tiny_backbone,
)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], check=False, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _schema_rows(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT version FROM polyserve_schema ORDER BY version")]


def test_db_upgrade_is_idempotent_and_safe_when_four_processes_run_it_at_once():
    with temp_database() as dsn:
        procs = [subprocess.Popen([sys.executable, "-m", "server.cli", "db", "upgrade", "--store", dsn],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
        said = [o[0] for o in outs]
        assert sum("applied migration" in s for s in said) == 1 and sum("up to date" in s for s in said) == 3
        assert _schema_rows(dsn) == list(range(1, SCHEMA_VERSION + 1))
        again = _cli("db", "upgrade", "--store", dsn)
        assert again.returncode == 0 and "already up to date" in again.stdout
        assert "postgres@" in again.stdout or "127.0.0.1" in again.stdout


def test_db_upgrade_refuses_a_directory_and_a_newer_schema(tmp_path):
    out = _cli("db", "upgrade", "--store", str(tmp_path))
    assert out.returncode != 0 and "postgresql://" in out.stderr
    with temp_database() as dsn:
        assert _cli("db", "upgrade", "--store", dsn).returncode == 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO polyserve_schema (version) VALUES (%s)", (SCHEMA_VERSION + 1,))
        newer = _cli("db", "upgrade", "--store", dsn)
        assert newer.returncode != 0 and "newer than this polyserve" in newer.stderr


INSTALLER = r"""
import sys
from adapters_store.store import open_store
from training.shipped_inventory import install_default_inventory
print(install_default_inventory(open_store(sys.argv[1]), source=sys.argv[2]), flush=True)
"""


def test_four_processes_install_the_default_inventory_exactly_once(tmp_path):
    source = build_store(tmp_path / "shipped")  # the package data has the store's layout
    with temp_database() as dsn:
        procs = [subprocess.Popen([sys.executable, "-c", INSTALLER, dsn, str(source.root)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(4)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0, 0], outs
        assert sorted(o[0].strip() for o in outs) == ["False", "False", "False", "True"]
        store = open_store(dsn)
        assert store.inventory_info() == source.inventory_info()
        assert [r.id for r in store.list_tasks()] == sorted(TASKS)
        for task in TASKS:
            assert store.get_task(task) == source.get_task(task)
            assert torch.equal(store.load_routing(task), source.load_routing(task))
        store.close()


def test_store_copy_moves_everything_verifies_and_refuses_a_different_destination(tmp_path):
    src = build_store(tmp_path / "dir")
    src.put_job({"id": "job-done01", "task": "alpha", "status": "succeeded", "finished_at": time.time()})
    src.put_job_examples("job-done01", [{"input": "a", "output": "b"}])
    src.put_job({"id": "job-live01", "task": "beta", "status": "running"})
    with temp_database() as dsn:
        out = _cli("store", "copy", "--from", str(src.root), "--to", dsn)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["verified"] and report["tasks"] == len(TASKS) and report["jobs"] == 1
        assert report["unfinished_jobs_left_out"] == ["job-live01"]
        pg = open_store(dsn)
        assert pg.get_job("job-done01")["status"] == "succeeded"
        assert pg.get_job_examples("job-done01") == [{"input": "a", "output": "b"}]
        again = json.loads(_cli("store", "copy", "--from", str(src.root), "--to", dsn).stdout.strip().splitlines()[-1])
        assert again["tasks"] == 0 and again["tasks_already_there"] == len(TASKS)
        back = tmp_path / "back"
        assert _cli("store", "copy", "--from", dsn, "--to", str(back)).returncode == 0
        copied = open_store(back)
        assert copied.list_tasks() == src.list_tasks()
        assert copied.inventory_info() == src.inventory_info()
        src.put_routing("alpha", torch.zeros_like(src.load_routing("alpha")))  # now they differ
        refused = _cli("store", "copy", "--from", str(src.root), "--to", dsn)
        assert refused.returncode != 0 and "'alpha' differs" in refused.stderr
        assert pg.get_task("alpha").version == 1  # nothing written
        pg.close()


def test_a_node_with_only_the_dsn_serves_every_task_as_the_directory_store_does(tmp_path):
    src = build_store(tmp_path / "dir")
    prompts = {task: f"{task} 1 2" for task in TASKS}
    with live_server(settings_for(tmp_path, store=str(src.root)), backbone=tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        want = {t: c.post("/v1/generate", json={"task": t, "prompt": p, "max_new_tokens": 8}).json()["text"]
                for t, p in prompts.items()}
    with temp_database() as dsn:
        assert _cli("store", "copy", "--from", str(src.root), "--to", dsn).returncode == 0
        home = tmp_path / "fresh-node"  # nothing here: no store, no cached inventory
        port = free_port()
        proc = serve_process(dsn, str(home), port, None)
        try:
            wait_process_ready(proc, f"http://127.0.0.1:{port}")
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
                got = {t: c.post("/v1/generate", json={"task": t, "prompt": p, "max_new_tokens": 8}).json()["text"]
                       for t, p in prompts.items()}
                listed = sorted(m["id"] for m in c.get("/v1/tasks").json()["data"])
        finally:
            proc.terminate()
            proc.wait(20)
        assert got == want
        assert set(TASKS) <= set(listed)
        version = src.inventory_info().version
        assert (home / "inventories" / f"{version}.safetensors").is_file()  # the node's copy of the skills


def _allow_connections(dsn: str, allow: bool) -> None:
    name = dsn.rsplit("/", 1)[1]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as admin:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allow else "false"}')
        if not allow:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))


def test_database_gone_answers_503_store_unavailable_then_recovers_by_itself(tmp_path):
    """The database stops taking connections under a running server (every session ended, as in a
    restart): a task the replica holds keeps serving, one it never read and a task read answer
    503 store_unavailable, and once the database is back the same requests succeed with no restart."""
    src = build_store(tmp_path / "dir")
    with temp_database() as dsn:
        assert _cli("store", "copy", "--from", str(src.root), "--to", dsn).returncode == 0
        with live_server(settings_for(tmp_path, store=dsn), backbone=tiny_backbone()) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as c:
            body = {"task": "alpha", "prompt": "a b", "max_new_tokens": 4}
            before = c.post("/v1/generate", json=body)
            assert before.status_code == 200
            _allow_connections(dsn, False)
            try:
                held = c.post("/v1/generate", json=body)  # alpha's adapter is in memory: it keeps serving
                assert held.status_code == 200 and held.json()["text"] == before.json()["text"]
                cold = c.post("/v1/generate", json={**body, "task": "gamma"})  # never read: needs the store
                assert cold.status_code == 503 and cold.json()["error"]["type"] == "store_unavailable"
                down = c.get("/v1/tasks/beta")
                assert down.status_code == 503 and down.json()["error"]["type"] == "store_unavailable"
                assert "Retry-After" in down.headers
                assert dsn.rsplit("/", 1)[1] not in down.text  # no location leaks to clients
            finally:
                _allow_connections(dsn, True)
            deadline = time.time() + 15
            while (after := c.get("/v1/tasks/beta")).status_code != 200:
                assert time.time() < deadline, after.text
                time.sleep(0.2)
            assert c.post("/v1/generate", json=body).json()["text"] == before.json()["text"]


def test_a_store_that_cannot_be_reached_is_a_clear_error():
    with pytest.raises(StoreError, match="unreachable"):
        open_store("postgresql://postgres@127.0.0.1:1/none")


def test_changes_reach_another_replica_through_notify_with_no_redis_and_no_rescan(tmp_path):
    """Two replicas on one database, no Redis, re-scans a minute apart: only LISTEN/NOTIFY can
    make A drop the adapters it holds for a task deleted through B, or rewritten by another
    process, within 1 s (requests re-read the record, so what would go stale is A's cache)."""
    src = build_store(tmp_path / "dir")
    body = {"task": "beta", "prompt": "x y", "max_new_tokens": 8}
    with temp_database() as dsn:
        assert _cli("store", "copy", "--from", str(src.root), "--to", dsn).returncode == 0
        port = free_port()
        other = serve_process(dsn, str(tmp_path / "node-b"), port, None, {"POLYSERVE_RESCAN_SECONDS": "60"})
        try:
            with live_server(settings_for(tmp_path, store=dsn, rescan_seconds=60), backbone=tiny_backbone()) as srv, \
                    httpx.Client(base_url=srv.url, timeout=30) as a, \
                    httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as b:
                wait_process_ready(other, f"http://127.0.0.1:{port}")
                l1 = srv.runtime.cache.l1
                for task in ("alpha", "beta"):
                    assert a.post("/v1/generate", json={**body, "task": task}).status_code == 200
                    assert any(f":{task}:" in k for k in l1.keys())  # noqa: SIM118 - L1Cache.keys() is a method
                assert b.delete("/v1/tasks/alpha").status_code == 204
                t0 = time.time()
                while any(":alpha:" in k for k in l1.keys()):  # noqa: SIM118
                    assert time.time() - t0 < 1.0, "A still holds a task deleted through B"
                    time.sleep(0.02)
                writer = open_store(dsn)
                writer.put_routing("beta", -3 * writer.load_routing("beta"))
                writer.close()
                t0 = time.time()
                while any(":beta:" in k for k in l1.keys()):  # noqa: SIM118
                    assert time.time() - t0 < 1.0, "A still holds beta's old row"
                    time.sleep(0.02)
                assert a.post("/v1/generate", json={**body, "task": "alpha"}).status_code == 404
                assert b.get("/v1/tasks/beta").json()["version"] == 2
        finally:
            other.terminate()
            other.wait(20)
