"""A fleet as separate processes on the real PostgreSQL: two serving replicas (POLYSERVE_JOBS=off,
tiny backbone) and two `polyserve worker`s, each with its own POLYSERVE_HOME and no shared
directory; they share the database only. Jobs are leased for LEASE_SECONDS.

The fleet is started once for the module (four processes starting at once); the test that kills a
worker runs last. Each test names the mechanism it would catch failing."""

from __future__ import annotations

import shutil
import threading
import time

import psycopg
import pytest

from tests.support.fleet_utils import (
    EXAMPLES,
    LEASE_SECONDS,
    queue_row,
    seed_database,
    start,
    wait_job,
    waiting_on_advisory_lock,
)
from tests.support.pg_utils import temp_database
from tests.support.server_fixtures import build_store

ONE = [{"input": "w1 x1", "output": "x1 w1"}]  # one example: nothing held out, every step runs
ONE_ALLOWED = {"POLYSERVE_MIN_EXAMPLES_PER_TASK": "1"}  # below the default minimum, for these jobs' sake


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fleet")
    with temp_database("polyserve_fleet") as dsn:
        seed_database(dsn, tmp)
        procs = {name: start(kind, name, dsn, tmp, env=ONE_ALLOWED)
                 for name, kind in (("a", "serve"), ("b", "serve"), ("w1", "worker"), ("w2", "worker"))}
        try:
            for proc in procs.values():
                proc.wait_ready()
            yield dsn, procs
        finally:
            for proc in procs.values():
                proc.stop()


def _tasks_row(dsn: str, task: str) -> tuple | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT record->>'status', record->>'version' FROM tasks WHERE id = %s",
                            (task,)).fetchone()


def _events(client, job_id: str) -> list[str]:
    return [e["message"] for e in client.get(f"/v1/jobs/{job_id}/events").json()["data"]]


def _running(client, job_id: str, timeout: float = 30, progress: float = 0.0) -> dict:
    """Wait (through `client`'s replica) until the job runs with more than `progress` done."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] in ("queued", "running"), job
        if job["status"] == "running" and job["progress"] > progress:
            return job
        time.sleep(0.02)
    raise TimeoutError(f"job {job_id} never ran past {progress}")


def test_register_on_a_serve_on_b_trained_by_a_worker(fleet):
    """Catches: a replica with POLYSERVE_JOBS=off running the job itself (the events say who
    claimed it), and progress or events that only the process running the job can see."""
    dsn, procs = fleet
    with procs["a"].client() as a, procs["b"].client() as b:
        r = a.post("/v1/tasks",
                   json={"task": "swap-fleet", "method": "routing", "examples": EXAMPLES, "steps": 30, "seed": 1})
        assert r.status_code == 202, r.text
        job = wait_job(b, r.json()["id"])
        assert job["status"] == "succeeded", job
        assert job["progress"] == 1.0 and job["metrics"]["steps_run"] >= 1
        events = _events(b, job["id"])
        assert any(m.startswith("claimed by worker-") for m in events), events
        assert queue_row(dsn, job["id"]) is None  # finished: its queue entry is gone
        out = b.post("/v1/generate", json={"task": "swap-fleet", "prompt": "w3 x3", "max_new_tokens": 4})
        assert out.status_code == 200, out.text
        assert b.get("/v1/tasks/swap-fleet").json()["version"] == 1


def test_cancel_through_b_reaches_the_worker(fleet):
    """Catches: a worker that never reads the store's cancel markers (the job would run its 5000
    steps), and a cancelled job that leaves its placeholder task or its queue entry behind."""
    dsn, procs = fleet
    with procs["a"].client() as a, procs["b"].client() as b:
        job = a.post("/v1/tasks",
                     json={"task": "cancel-me", "method": "routing", "examples": ONE, "steps": 5000}).json()
        running = _running(b, job["id"])
        assert running["progress"] < 0.5
        t0 = time.time()
        assert b.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
        done = wait_job(a, job["id"], timeout=10)
        assert done["status"] == "cancelled" and time.time() - t0 < 5
        assert a.get("/v1/tasks/cancel-me").status_code == 404
        assert b.get("/v1/tasks/cancel-me").status_code == 404
        assert queue_row(dsn, job["id"]) is None


def test_delete_through_b_while_a_worker_commits(fleet):
    """The delete and the worker's commit race for the task's lock; the test holds it so that B's
    delete waits first and the worker's commit second. Catches a commit that does not re-check,
    under the lock, that its task still exists: it would bring the deleted task back."""
    dsn, procs = fleet
    task = "delete-race"
    with procs["a"].client() as a, procs["b"].client() as b, psycopg.connect(dsn, autocommit=True) as lock:
        job = a.post("/v1/tasks", json={"task": task, "method": "routing", "examples": ONE, "steps": 200}).json()
        lock.execute("SELECT pg_advisory_lock(7301, hashtext(%s))", (task,))  # the PostgreSQL store's _NS_DECIDE
        answer: dict = {}
        deleter = threading.Thread(target=lambda: answer.setdefault("r", b.delete(f"/v1/tasks/{task}")))
        deleter.start()
        deadline = time.time() + 30
        while not waiting_on_advisory_lock(dsn, "fleet-b"):
            assert time.time() < deadline, "B's delete never waited for the task lock"
            time.sleep(0.02)
        while not (waiting_on_advisory_lock(dsn, "fleet-w1") or waiting_on_advisory_lock(dsn, "fleet-w2")):
            assert time.time() < deadline, "no worker reached its commit"
            time.sleep(0.02)
        lock.execute("SELECT pg_advisory_unlock(7301, hashtext(%s))", (task,))
        deleter.join(30)
        assert answer["r"].status_code == 204, answer["r"].text
        done = wait_job(b, job["id"], timeout=15)
        assert done["status"] == "cancelled", done
        assert "the task was deleted while the job ran; result discarded" in _events(a, job["id"])
        time.sleep(0.5)  # nothing lands later either
        assert _tasks_row(dsn, task) is None
        assert a.get(f"/v1/tasks/{task}").status_code == 404 and b.get(f"/v1/tasks/{task}").status_code == 404
        assert queue_row(dsn, job["id"]) is None


def test_a_workers_connection_dropped_mid_job_loses_no_job(fleet):
    """Every session of both workers is ended (pg_terminate_backend) three times while the job
    trains, then once more while its commit waits for the task's lock (the test holds it). Catches
    a worker whose store calls die with their connection: the job would fail (store_error), stay
    running, be committed twice, or lose its lease and run again elsewhere (attempt 2)."""
    dsn, procs = fleet
    task = "dropped"
    apps = "application_name IN ('fleet-w1', 'fleet-w2')"
    with procs["a"].client() as a, procs["b"].client() as b, psycopg.connect(dsn, autocommit=True) as admin:
        job = a.post("/v1/tasks", json={"task": task, "method": "routing", "examples": ONE, "steps": 600}).json()
        admin.execute("SELECT pg_advisory_lock(7301, hashtext(%s))", (task,))  # the commit will wait
        try:
            _running(b, job["id"])
            ended = 0
            for _ in range(3):
                ended += len(admin.execute(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE {apps}")
                             .fetchall())
                time.sleep(0.3)
            assert ended >= 3
            deadline = time.time() + 60
            while not (waiting_on_advisory_lock(dsn, "fleet-w1") or waiting_on_advisory_lock(dsn, "fleet-w2")):
                assert time.time() < deadline, "no worker reached its commit"
                time.sleep(0.02)
            ended = admin.execute("SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity s "
                                  f"ON s.pid = l.pid WHERE l.locktype = 'advisory' AND NOT l.granted AND s.{apps}"
                                  ).fetchall()
            assert len(ended) == 1  # the session waiting to commit
        finally:
            admin.execute("SELECT pg_advisory_unlock(7301, hashtext(%s))", (task,))
        done = wait_job(b, job["id"], timeout=60)
        assert done["status"] == "succeeded", (done, procs["w1"].tail(), procs["w2"].tail())
        assert done["metrics"]["steps_run"] == 600
        events = _events(b, job["id"])
        assert not any("(attempt 2)" in m for m in events), events  # the worker kept its job and its lease
        assert _tasks_row(dsn, task) == ("ready", "1")
        assert b.post("/v1/generate", json={"task": task, "prompt": "w1 x1", "max_new_tokens": 2}).status_code == 200


def test_a_worker_killed_mid_job_has_its_job_finished_by_the_other_within_the_lease(fleet):
    """SIGKILL the worker that holds the job: its lease runs out and the other worker runs the job
    again (attempt 2) and commits it once. Catches leases that never expire or a claim that skips
    expired ones (the job would stay running), and a second commit (version 2). Runs last: it
    leaves the fleet with one worker."""
    dsn, procs = fleet
    with procs["a"].client() as a, procs["b"].client() as b:
        solo_t0 = time.time()
        solo = a.post("/v1/tasks", json={"task": "solo", "method": "routing", "examples": ONE, "steps": 600}).json()
        assert wait_job(b, solo["id"])["status"] == "succeeded"
        solo_seconds = time.time() - solo_t0
        job = a.post("/v1/tasks", json={"task": "killed", "method": "routing", "examples": ONE, "steps": 600}).json()
        _running(b, job["id"], progress=0.1)
        owner = queue_row(dsn, job["id"])[0]
        victim = next(p for n, p in procs.items() if n.startswith("w") and f"-{p.popen.pid}-" in owner)
        victim.kill()
        t0 = time.time()
        done = wait_job(b, job["id"], timeout=LEASE_SECONDS + solo_seconds + 30)
        took = time.time() - t0
        assert done["status"] == "succeeded", done
        assert took < LEASE_SECONDS + solo_seconds + 5, (took, solo_seconds)
        events = _events(a, job["id"])
        assert any("(attempt 2)" in m for m in events), events
        assert _tasks_row(dsn, "killed") == ("ready", "1")  # committed once
        assert queue_row(dsn, job["id"]) is None


def test_jobs_off_and_a_worker_on_one_machines_directory_store(tmp_path):
    """The queue's directory backend: a replica that only enqueues and a worker sharing one store
    directory. Catches a queue that works on PostgreSQL only (the job would stay queued)."""
    root = build_store(tmp_path / "store").root
    procs = [start("serve", "dir-a", str(root), tmp_path), start("worker", "dir-w", str(root), tmp_path)]
    try:
        for proc in procs:
            proc.wait_ready()
        with procs[0].client() as a:
            job = a.post("/v1/tasks",
                         json={"task": "on-disk", "method": "routing", "examples": EXAMPLES, "steps": 10}).json()
            done = wait_job(a, job["id"])
            assert done["status"] == "succeeded", (done, procs[1].tail())
            assert any(m.startswith("claimed by worker-") for m in _events(a, job["id"]))
            assert a.post("/v1/generate",
                          json={"task": "on-disk", "prompt": "w1", "max_new_tokens": 2}).status_code == 200
        assert not list((root / "jobs" / "queue").glob("job-*.json"))  # finished: its entry is gone
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.slow
def test_four_processes_starting_at_once_on_an_empty_database_install_the_default_inventory_once(tmp_path):
    """Two replicas and two workers on the default backbone, started together on an empty
    database: exactly one installs the shipped inventory, and all four come up. Each home gets
    its own copy of the dequantised backbone (the first load's cache), so no directory is shared."""
    from adapters_store.backbone.load import warm_default_cache
    from training.shipped_inventory import PACKAGE_DIR, below_floor, shipped_records

    warm = warm_default_cache()
    with temp_database("polyserve_fleet4") as dsn:
        procs = []
        for name, kind in (("a", "serve"), ("b", "serve"), ("w1", "worker"), ("w2", "worker")):
            cache = tmp_path / f"home-{name}" / "backbones" / warm.name
            shutil.copytree(warm, cache)
            procs.append(start(kind, name, dsn, tmp_path, backbone="default", env={"POLYSERVE_WARMUP": "0"}))
        try:
            for proc in procs:
                proc.wait_ready(timeout=300)
            logs = [proc.tail(10**6) for proc in procs]
            assert sum("installed the default inventory" in log for log in logs) == 1, logs
            with psycopg.connect(dsn) as conn:
                assert conn.execute("SELECT count(*) FROM inventories").fetchone()[0] == 1
                versions = dict(conn.execute("SELECT id, (record->>'version')::int FROM tasks").fetchall())
            shipped = {task: r.version for task, r in shipped_records(PACKAGE_DIR).items() if not below_floor(r)}
            assert versions == shipped  # every shipped task above the quality floor imported as shipped, once
            with procs[1].client() as b:
                assert len(b.get("/v1/models").json()["data"]) > 1
        finally:
            for proc in procs:
                proc.stop()

