"""Per-tenant registration quotas over HTTP (tiny model), both kinds of key set: jobs queued or
running (429 tenant_job_limit; by default a tenant's weighted share of POLYSERVE_MAX_QUEUED_JOBS,
also counted from the fleet's queue with POLYSERVE_JOBS=off) and tasks owned (409
tenant_task_limit), each counted in polyserve_tenant_refused_total{tenant,limit}; admins exempt."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest

from server.jobs.service import job_quota, task_quota
from server.tenancy.tenants import ANONYMOUS, Tenant, weighted_share
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(6)]
ALICE, BOB, ROOT = "key-alice-q1", "key-bob-q2", "key-root-q3"
KEYS = {"api_keys": [f"alice:{ALICE}", f"bob:{BOB}"], "admin_keys": [f"root:{ROOT}"]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def long_job(c: httpx.Client, task: str, key: str) -> httpx.Response:
    return c.post("/v1/tasks", json={"task": task, "method": "routing", "examples": EXAMPLES, "steps": 5000},
                  headers=auth(key))


def wait_job(c: httpx.Client, job_id: str, key: str) -> dict:
    deadline = time.time() + 60
    while time.time() < deadline:
        job = c.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise TimeoutError(job_id)


def refused(c: httpx.Client, tenant: str, limit: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(f'polyserve_tenant_refused_total{{limit="{limit}",tenant="{tenant}"}}'):
            return float(line.split()[-1])
    return 0.0


# -- the defaults ----------------------------------------------------------------------------------
def test_default_quotas_are_weighted_shares_and_bind_only_tenants():
    weights = {"alice": 1.0, "bob": 2.0, "root": 1.0}
    settings = SimpleNamespace(max_queued_jobs=16, max_tasks=None, tenant_max_jobs=None, tenant_max_tasks=None)
    alice, bob = Tenant("alice"), Tenant("bob", 2.0)
    assert (job_quota(settings, weights, alice), job_quota(settings, weights, bob)) == (4, 8)
    assert task_quota(settings, weights, alice) is None  # no POLYSERVE_MAX_TASKS: no default
    settings.max_tasks = 10
    assert (task_quota(settings, weights, alice), task_quota(settings, weights, bob)) == (3, 5)
    settings.tenant_max_jobs, settings.tenant_max_tasks = 1, 2
    assert (job_quota(settings, weights, bob), task_quota(settings, weights, bob)) == (1, 2)
    for exempt in (Tenant("root", admin=True), ANONYMOUS, None):
        assert job_quota(settings, weights, exempt) is None and task_quota(settings, weights, exempt) is None
    assert weighted_share(16, {"default": 1.0}, "default") == 16  # one tenant: the whole limit
    assert weighted_share(3, {t: 1.0 for t in "abcdefgh"}, "a") == 1  # never 0


# -- jobs and tasks, this replica running the jobs ---------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("quotas")
    build_store(root / "store")
    # 3 tenants of weight 1 (the admin counts): each may hold ceil(4 / 3) = 2 of the 4 queued jobs
    settings = settings_for(root, warmup=False, max_queued_jobs=4, tenant_max_tasks=3, **KEYS)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield srv, c


def test_one_tenant_cannot_fill_the_job_queue(server):
    _, c = server
    jobs = []
    for i in range(2):
        r = long_job(c, f"alice-long-{i}", ALICE)
        assert r.status_code == 202, r.text
        jobs.append((r.json()["id"], ALICE))
    r = long_job(c, "alice-long-2", ALICE)
    assert r.status_code == 429 and r.headers["Retry-After"] == "30", r.text
    error = r.json()["error"]
    assert error["type"] == "tenant_job_limit" and "POLYSERVE_TENANT_MAX_JOBS" in error["message"]
    assert c.get("/v1/tasks/alice-long-2", headers=auth(ALICE)).status_code == 404  # nothing written
    assert refused(c, "alice", "jobs") == 1
    r = long_job(c, "bob-long", BOB)  # the queue still has room for the others
    assert r.status_code == 202, r.text
    jobs.append((r.json()["id"], BOB))
    r = long_job(c, "root-long", ROOT)  # admins are exempt; the global limit still holds
    assert r.status_code == 202, r.text
    jobs.append((r.json()["id"], ROOT))
    r = long_job(c, "root-long-2", ROOT)
    assert r.status_code == 429 and r.json()["error"]["type"] == "overloaded", r.text
    for job_id, key in jobs:
        assert c.post(f"/v1/jobs/{job_id}/cancel", headers=auth(key)).status_code == 200
        assert wait_job(c, job_id, key)["status"] == "cancelled"
    r = long_job(c, "alice-long-2", ALICE)  # hers finished: room again
    assert r.status_code == 202, r.text
    assert c.post(f"/v1/jobs/{r.json()['id']}/cancel", headers=auth(ALICE)).status_code == 200
    wait_job(c, r.json()["id"], ALICE)


def test_a_tenant_owns_at_most_its_task_quota(server):
    srv, c = server
    store = srv.runtime.store
    owned = lambda: sorted(t.id for t in store.list_tasks() if t.owner == "alice")
    for task in owned():  # what the job test left (cancelled jobs may leave no task)
        assert c.delete(f"/v1/tasks/{task}", headers=auth(ALICE)).status_code == 204
    for i in range(3):
        r = c.post("/v1/tasks", json={"task": f"alice-t{i}", "examples": EXAMPLES, "method": "retrieve"},
                   headers=auth(ALICE))
        assert r.status_code == 202, r.text
        assert wait_job(c, r.json()["id"], ALICE)["status"] == "succeeded"
    r = c.post("/v1/tasks", json={"task": "alice-t3", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(ALICE))
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["type"] == "tenant_task_limit" and "POLYSERVE_TENANT_MAX_TASKS" in error["message"]
    assert refused(c, "alice", "tasks") == 1 and owned() == ["alice-t0", "alice-t1", "alice-t2"]
    r = c.post("/v1/tasks", json={"task": "bob-t0", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(BOB))
    assert r.status_code == 202, r.text  # bob's count is his own
    wait_job(c, r.json()["id"], BOB)
    assert c.delete("/v1/tasks/alice-t0", headers=auth(ALICE)).status_code == 204
    r = c.post("/v1/tasks", json={"task": "alice-t3", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(ALICE))
    assert r.status_code == 202, r.text
    wait_job(c, r.json()["id"], ALICE)


# -- jobs counted from the fleet's queue (workers run them) -----------------------------------------
def test_the_job_quota_counts_the_fleet_queue_when_workers_run_the_jobs(tmp_path):
    """POLYSERVE_JOBS=off: the replica runs nothing, so a tenant's jobs are counted in the store's
    queue (and two replicas' submits see each other's)."""
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, jobs="off", max_queued_jobs=8, tenant_max_jobs=2, warmup=False, **KEYS)
    with live_server(settings, backbone=tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        ids = []
        for i in range(2):
            r = c.post("/v1/tasks", json={"task": f"backlog-{i}", "examples": EXAMPLES}, headers=auth(ALICE))
            assert r.status_code == 202, r.text
            ids.append(r.json()["id"])
        assert srv.runtime.store.queued_jobs("alice") == 2 and srv.runtime.registration.runner.pending == 0
        r = c.post("/v1/tasks", json={"task": "backlog-2", "examples": EXAMPLES}, headers=auth(ALICE))
        assert r.status_code == 429 and r.json()["error"]["type"] == "tenant_job_limit", r.text
        assert refused(c, "alice", "jobs") == 1
        r = c.post("/v1/tasks", json={"task": "bob-backlog", "examples": EXAMPLES}, headers=auth(BOB))
        assert r.status_code == 202, r.text
        assert c.post(f"/v1/jobs/{ids[0]}/cancel", headers=auth(ALICE)).json()["status"] == "cancelled"
        r = c.post("/v1/tasks", json={"task": "backlog-2", "examples": EXAMPLES}, headers=auth(ALICE))
        assert r.status_code == 202, r.text
