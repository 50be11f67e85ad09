"""Registration limits that must hold under concurrency: the queued-jobs limit against a burst of
POSTs, POLYSERVE_MAX_TASKS, and task lock files (made only for real ids, swept once a task is
gone, and still exclusive when a sweep and a locker race)."""

from __future__ import annotations

import fcntl
import threading
import time

import httpx
import pytest

from adapters_store.store.directory import DirectoryStore
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(6)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    build_store(root / "store")
    settings = settings_for(root, warmup=False, max_queued_jobs=2, max_tasks=6)
    with live_server(settings, tiny_backbone()) as srv:
        yield srv


def test_a_burst_of_registrations_cannot_pass_the_queued_jobs_limit(server):
    """8 POSTs at once, each a long job: exactly 2 are queued, the others answer 429."""
    barrier = threading.Barrier(8)
    codes: list[int] = []

    def post(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            barrier.wait()
            r = c.post("/v1/tasks", json={"task": f"burst-{i}", "examples": EXAMPLES, "steps": 5000})
            codes.append(r.status_code)

    threads = [threading.Thread(target=post, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(codes) == [202, 202] + [429] * 6, codes
    with httpx.Client(base_url=server.url, timeout=60) as c:  # free the runner for the next tests
        for task in [t["id"] for t in c.get("/v1/tasks").json()["data"] if t["id"].startswith("burst-")]:
            assert c.delete(f"/v1/tasks/{task}").status_code == 204


def wait_job(c: httpx.Client, job_id: str) -> None:
    deadline = time.time() + 60
    while c.get(f"/v1/jobs/{job_id}").json()["status"] not in ("succeeded", "failed", "cancelled"):
        assert time.time() < deadline
        time.sleep(0.05)


def test_max_tasks_refuses_a_new_task_with_task_limit(server):
    store: DirectoryStore = server.runtime.store
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert len(store.task_stamps()) == 4  # alpha .. delta
        for task in ("fifth", "sixth"):
            r = c.post("/v1/tasks", json={"task": task, "examples": EXAMPLES, "method": "retrieve"})
            assert r.status_code == 202, r.text
            wait_job(c, r.json()["id"])
        r = c.post("/v1/tasks", json={"task": "seventh", "examples": EXAMPLES, "method": "retrieve"})
        assert r.status_code == 409 and r.json()["error"]["type"] == "task_limit", r.text
        assert c.delete("/v1/tasks/alpha").status_code == 204
        r = c.post("/v1/tasks", json={"task": "seventh", "examples": EXAMPLES, "method": "retrieve"})
        assert r.status_code == 202, r.text
        wait_job(c, r.json()["id"])


def test_deleting_a_task_that_does_not_exist_makes_no_lock_file(server):
    store: DirectoryStore = server.runtime.store
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for i in range(20):
            assert c.delete(f"/v1/tasks/never-{i}").status_code == 404
    assert not [p for p in (store.root / "locks").glob("task-never-*")]


def test_lock_files_of_deleted_tasks_are_swept(server):
    store: DirectoryStore = server.runtime.store
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.delete("/v1/tasks/beta").status_code == 204
    assert not (store.root / "locks" / "task-beta.lock").exists()
    assert {p.name for p in (store.root / "locks").glob("task-*.lock")} <= {
        f"task-{t}.lock" for t in store.task_stamps()}


def test_a_sweep_never_removes_a_held_lock(tmp_path):
    store = build_store(tmp_path / "store", tasks=("kept",))
    with store.task_lock("gone"):
        assert store.sweep_task_locks() == 0  # held: left alone
        assert (store.root / "locks" / "task-gone.lock").exists()
    assert store.sweep_task_locks() == 1 and not (store.root / "locks" / "task-gone.lock").exists()


def test_a_locker_waiting_on_a_swept_file_takes_the_new_one(tmp_path):
    """A waits on the lock file, the sweep unlinks it and lets go: A must not now hold a lock on the
    orphaned file while B locks the new one (two holders of one task's lock)."""
    store = build_store(tmp_path / "store", tasks=("kept",))
    path = store.root / "locks" / "task-gone.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    sweeper = open(path, "a+")  # noqa: SIM115 - the sweep's hold
    fcntl.flock(sweeper, fcntl.LOCK_EX)
    a_inside, a_done = threading.Event(), threading.Event()

    def a() -> None:
        with store.task_lock("gone"):
            a_inside.set()
            time.sleep(0.5)
            a_done.set()  # the last thing A does while it holds the lock

    thread = threading.Thread(target=a)
    thread.start()
    time.sleep(0.3)  # A has opened the file and waits on its lock
    path.unlink()  # what sweep_task_locks does while it holds the lock
    fcntl.flock(sweeper, fcntl.LOCK_UN)
    sweeper.close()
    assert a_inside.wait(10)
    with store.task_lock("gone"):
        assert a_done.is_set(), "B got the task lock while A held it"
    thread.join(10)
