"""Job control across replicas: two real server processes sharing one store, no Redis (the store
is the fallback channel). One owner per new task id; cancel and delete work through either replica;
a job's commit never brings back a task deleted elsewhere."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.jobs.test_registration_api import EXAMPLES, serve_process, wait_process_ready
from tests.support.server_fixtures import build_store, free_port, live_server, settings_for, tiny_backbone

LONG = {"examples": EXAMPLES, "steps": 5000}  # runs far longer than the test


@pytest.fixture
def replicas(tmp_path):
    build_store(tmp_path / "store")
    port = free_port()
    other = serve_process(str(tmp_path / "store"), str(tmp_path), port, None)
    try:
        with live_server(settings_for(tmp_path), backbone=tiny_backbone()) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as a, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as b:
            wait_process_ready(other, f"http://127.0.0.1:{port}")
            yield a, b
    finally:
        other.terminate()
        other.wait(20)


def wait_status(client: httpx.Client, job_id: str, want: str, timeout: float = 20) -> dict:
    deadline = time.time() + timeout
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] != want:
        assert time.time() < deadline, f"job {job_id} is {job['status']!r}, never {want!r}"
        time.sleep(0.05)
    return job


def test_one_owner_per_new_task_id_across_processes(replicas):
    a, b = replicas
    for i in range(6):
        task = f"race-{i}"
        go = threading.Barrier(2)
        codes: dict[str, int] = {}
        body = {"task": task, "steps": 2, "method": "routing", "examples": EXAMPLES}

        def post(name: str, client: httpx.Client, body: dict = body, go: threading.Barrier = go,
                 codes: dict[str, int] = codes) -> None:
            go.wait()
            codes[name] = client.post("/v1/tasks", json=body).status_code

        threads = [threading.Thread(target=post, args=(n, c)) for n, c in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(codes.values()) == [202, 409], f"{task}: {codes}"


def test_cancel_through_the_other_replica(replicas):
    a, b = replicas
    job = a.post("/v1/tasks", json={"task": "cancel-me", **LONG}).json()
    wait_status(a, job["id"], "running")
    assert b.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    wait_status(a, job["id"], "cancelled")
    assert a.get("/v1/tasks/cancel-me").status_code == 404
    assert b.get("/v1/tasks/cancel-me").status_code == 404


def test_delete_through_the_other_replica_wins_over_the_running_job(replicas):
    a, b = replicas
    job = a.post("/v1/tasks", json={"task": "delete-me", **LONG}).json()
    wait_status(a, job["id"], "running")
    assert b.delete("/v1/tasks/delete-me").status_code == 204
    wait_status(a, job["id"], "cancelled")
    time.sleep(0.5)
    assert a.get("/v1/tasks/delete-me").status_code == 404
    assert b.get("/v1/tasks/delete-me").status_code == 404
    # the id is free again, through either replica
    assert b.post("/v1/tasks",
                  json={"task": "delete-me", "method": "routing", "examples": EXAMPLES, "steps": 2}).status_code == 202
