"""Registering a task over HTTP (tiny model, real HTTP, real Redis for the multi-replica test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import torch

from adapters_store.store.atomic import SWEEP_GRACE_SECONDS
from adapters_store.store.directory import DirectoryStore
from tests.support.server_fixtures import (
    build_store,
    free_port,
    live_server,
    redis_up,
    settings_for,
    tiny_backbone,
)

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(12)]
REDIS = "redis://127.0.0.1:6379/0"



def wait_job(client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(f"job {job_id} still {job['status']}")


@pytest.fixture
def server(tmp_path):
    store = build_store(tmp_path / "store")
    info = store.inventory_info()
    store.put_routing("mu", torch.zeros(len(info.layer_names), info.spec.n_heads, info.spec.n_skills))
    with live_server(settings_for(tmp_path, max_examples_per_task=50), backbone=tiny_backbone()) as srv:
        yield srv


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def generate(client: httpx.Client, task: str, prompt: str = "w3 x3") -> httpx.Response:
    return client.post("/v1/generate", json={"task": task, "prompt": prompt, "max_new_tokens": 12})


def test_register_poll_succeed_generate(client):
    r = client.post("/v1/tasks",
                    json={"task": "swap-two", "method": "routing", "examples": EXAMPLES, "steps": 30, "seed": 1})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["task"] == "swap-two" and job["id"].startswith("job-")
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded", done
    assert done["progress"] == 1.0 and done["finished_at"] >= done["started_at"] >= done["created_at"]
    assert "eval_loss" in done["metrics"]
    # the estimate with its n and interval; 12 examples hold 3 out, below the floor: said so
    m = done["metrics"]
    assert m["eval_exact_n"] == m["n_held"] == 3 and m["eval_exact_level"] == 0.9
    assert 0.0 <= m["eval_exact_low"] <= m["eval_exact"] <= m["eval_exact_high"] <= 1.0
    assert m["eval_note"].startswith("too few held-out examples")
    task = client.get("/v1/tasks/swap-two").json()
    assert task["status"] == "ready" and task["method"] == "routing" and task["job_id"] == job["id"]
    assert task["params"] > 0
    events = client.get(f"/v1/jobs/{job['id']}/events").json()["data"]
    assert [e["data"].get("status") for e in events if e["type"] == "status"][-1] == "succeeded"
    new = generate(client, "swap-two")
    mu = generate(client, "mu")
    assert new.status_code == 200 and mu.status_code == 200
    assert new.json()["text"] != mu.json()["text"], "the learned routing should change the output vs μ"
    metrics = client.get("/metrics").text
    assert 'polyserve_jobs_total{status="succeeded"} 1.0' in metrics
    assert "polyserve_adaptation_seconds_count 1.0" in metrics


def test_retrieve_registers_a_mixture_of_existing_rows_without_training(client, tmp_path):
    """`retrieve` stores the mean of the rows it names (or μ), chosen by held-out loss, with no
    gradient step; the task answers at once. (Which row fits is tested in test_retrieve.py.)"""
    r = client.post("/v1/tasks", json={"task": "like-alpha", "examples": EXAMPLES, "method": "retrieve"})
    assert r.status_code == 202, r.text
    done = wait_job(client, r.json()["id"])
    assert done["status"] == "succeeded", done
    assert done["method"] == "retrieve" and done["progress"] == 1.0
    task = client.get("/v1/tasks/like-alpha").json()
    assert task["status"] == "ready" and task["method"] == "retrieve" and task["kind"] == "routing"
    m = task["metrics"]
    others = [t["id"] for t in client.get("/v1/tasks").json()["data"] if t["id"] not in ("base", "like-alpha")]
    assert m["candidates"] == len(others) and set(m["ranked"]) <= set(others)
    assert m["eval_loss"] == pytest.approx(min(m["held_losses"].values()), abs=1e-4)
    assert m["eval_loss"] <= m["mu_eval_loss"]
    store = DirectoryStore(tmp_path / "store")
    stored = store.load_routing("like-alpha")
    expected = torch.stack([store.load_routing(t) for t in m["retrieved"]]).mean(0) if m["retrieved"] \
        else torch.zeros_like(stored)
    assert torch.allclose(stored, expected), m["retrieved"]
    assert generate(client, "like-alpha").status_code == 200


def test_routing_registration_starts_from_retrieval(client):
    r = client.post("/v1/tasks",
                    json={"task": "swap-r", "method": "routing", "examples": EXAMPLES, "steps": 5, "seed": 1})
    done = wait_job(client, r.json()["id"])
    assert done["status"] == "succeeded", done
    metrics = client.get("/v1/tasks/swap-r").json()["metrics"]
    assert metrics["init"] == "retrieve" and "retrieve_eval_loss" in metrics
    assert metrics["initial_eval_loss"] == pytest.approx(metrics["retrieve_eval_loss"], rel=1e-2)


def wait_live(client: httpx.Client, job_id: str, version: int, timeout: float = 60) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["live_version"] == version:
            return job
        assert job["status"] in ("queued", "running"), job
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} never made version {version} live")


def test_serve_early_serves_the_retrieved_row_while_training_then_the_trained_one(client, tmp_path):
    r = client.post("/v1/tasks", json={"task": "early", "method": "routing", "examples": EXAMPLES, "steps": 40,
                                       "serve_early": True})
    assert r.status_code == 202 and r.json()["serve_early"] is True and r.json()["live_version"] is None
    job = wait_live(client, r.json()["id"], 1)
    assert job["status"] == "running"  # still training, and already servable:
    task = client.get("/v1/tasks/early").json()
    assert task["status"] == "ready" and task["version"] == 1 and task["metrics"]["method"] == "retrieve"
    assert generate(client, "early").status_code == 200
    retrieved = DirectoryStore(tmp_path / "store").load_routing("early")
    done = wait_job(client, job["id"])
    assert done["status"] == "succeeded" and done["live_version"] == 2
    task = client.get("/v1/tasks/early").json()
    assert task["version"] == 2 and task["method"] == "routing" and task["metrics"]["steps_run"] >= 1
    trained = DirectoryStore(tmp_path / "store").load_routing("early")
    assert not torch.equal(trained, retrieved)
    events = [e["message"] for e in client.get(f"/v1/jobs/{job['id']}/events").json()["data"]]
    assert any("version 1 while training" in m for m in events)


def test_serve_early_cancel_keeps_the_early_version_and_delete_wins(client):
    r = client.post("/v1/tasks", json={"task": "early-c", "method": "routing", "examples": EXAMPLES, "steps": 5000,
                                       "serve_early": True})
    job = wait_live(client, r.json()["id"], 1)
    assert client.post(f"/v1/jobs/{job['id']}/cancel").status_code == 200
    assert wait_job(client, job["id"])["status"] == "cancelled"
    task = client.get("/v1/tasks/early-c").json()
    assert task["status"] == "ready" and task["version"] == 1
    assert generate(client, "early-c").status_code == 200

    r = client.post("/v1/tasks", json={"task": "early-d", "method": "routing", "examples": EXAMPLES, "steps": 5000,
                                       "serve_early": True})
    job = wait_live(client, r.json()["id"], 1)
    assert client.delete("/v1/tasks/early-d").status_code == 204  # deleting a served task cancels its job
    assert wait_job(client, job["id"])["status"] == "cancelled"
    time.sleep(0.3)
    assert client.get("/v1/tasks/early-d").status_code == 404
    assert generate(client, "early-d").status_code == 404


def test_auto_with_serve_early_serves_its_demonstrations_first(client):
    r = client.post("/v1/tasks", json={"task": "early-auto", "examples": EXAMPLES, "steps": 2, "serve_early": True})
    assert r.status_code == 202 and r.json()["method"] == "auto" and r.json()["serve_early"] is True
    done = wait_job(client, r.json()["id"])
    assert done["status"] == "succeeded" and done["live_version"] == 2, done
    events = [e["message"] for e in client.get(f"/v1/jobs/{done['id']}/events").json()["data"]]
    assert "serving the demonstrations as version 1 while training goes on" in events
    task = client.get("/v1/tasks/early-auto").json()
    assert task["version"] == 2 and task["metrics"]["chosen"] in ("demos", "routing", "demos+routing")
    assert generate(client, "early-auto").status_code == 200


@pytest.mark.parametrize("method", ["retrieve", "demos", "demos+routing"])
def test_serve_early_is_refused_where_nothing_can_be_served_before_training(client, method):
    r = client.post("/v1/tasks", json={"task": "early-no", "method": method, "examples": EXAMPLES,
                                       "serve_early": True})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["param"] == "serve_early" and "auto" in r.json()["error"]["message"]


def test_conflicts_and_cancel(client):
    r = client.post("/v1/tasks", json={"task": "slow", "method": "routing", "examples": EXAMPLES, "steps": 5000})
    assert r.status_code == 202
    job_id = r.json()["id"]
    busy = generate(client, "slow")
    assert busy.status_code == 409
    assert busy.json()["error"]["type"] == "task_not_ready" and job_id in busy.json()["error"]["message"]
    dup = client.post("/v1/tasks", json={"task": "slow", "examples": EXAMPLES})
    assert dup.status_code == 409 and job_id in dup.json()["error"]["message"]
    assert client.post("/v1/tasks", json={"task": "alpha", "examples": EXAMPLES}).status_code == 409
    cancelled = client.post(f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200
    assert wait_job(client, job_id)["status"] == "cancelled"
    assert client.get("/v1/tasks/slow").status_code == 404
    assert client.get("/v1/jobs/job-doesnotexist").status_code == 404
    assert client.post("/v1/jobs/job-doesnotexist/cancel").status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"task": "t1", "examples": []}, "examples"),
    ({"task": "t1", "examples": [{"input": "a"}]}, "examples.0.output"),
    ({"task": "t1", "examples": [{"input": "", "output": "b"}]}, "examples.0.input"),
    ({"task": "t1", "examples": [{"input": "a" * 5000, "output": "b"}]}, "examples.0.input"),
    ({"task": "T1", "examples": EXAMPLES}, "task"),
    ({"task": "t1", "examples": EXAMPLES, "method": "magic"}, "method"),
    ({"task": "t1", "method": "routing", "examples": EXAMPLES, "steps": 0}, "steps"),
    ({"task": "t1", "examples": EXAMPLES, "method": "retrieve", "steps": 5}, "steps"),
    ({"task": "t1", "examples": [{"input": "a", "output": "b"}] * 51}, "examples"),
    ({"task": "base", "examples": EXAMPLES}, "task"),
])
def test_bad_registrations_are_422_naming_the_problem(client, body, field):
    r = client.post("/v1/tasks", json=body)
    assert r.status_code == 422, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(field) or f"{field}:" in message, message
    assert "aaaaaaaaaa" not in message  # never echoes the input
    assert client.get("/v1/tasks/t1").status_code == 404


def test_delete_task(client):
    assert generate(client, "beta").status_code == 200
    assert client.delete("/v1/tasks/beta").status_code == 204
    assert client.get("/v1/tasks/beta").status_code == 404
    assert generate(client, "beta").status_code == 404
    assert client.delete("/v1/tasks/beta").status_code == 404
    assert client.delete("/v1/tasks/base").status_code in (400, 409)


def wait_process_ready(proc: subprocess.Popen, url: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready")


def serve_process(store: str, home: str, port: int, redis_url: str | None,
                  extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "POLYSERVE_HOME": home, "POLYSERVE_STORE": store, "POLYSERVE_BACKBONE": "tiny",
           **(extra_env or {})}
    env.pop("POLYSERVE_REDIS_URL", None)
    if redis_url:
        env["POLYSERVE_REDIS_URL"] = redis_url
    return subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_crash_mid_job_leaves_nothing_half_written_and_no_running_job(tmp_path):
    build_store(tmp_path / "store")
    port = free_port()
    proc = serve_process(str(tmp_path / "store"), str(tmp_path), port, None)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_process_ready(proc, url)
        with httpx.Client(base_url=url, timeout=10) as c:
            job = c.post("/v1/tasks",
                         json={"task": "doomed", "method": "routing", "examples": EXAMPLES, "steps": 5000}).json()
            deadline = time.time() + 30
            while c.get(f"/v1/jobs/{job['id']}").json()["status"] != "running" and time.time() < deadline:
                time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    store_root = tmp_path / "store"
    committed = [p for p in store_root.rglob("*.safetensors") if "doomed" in str(p)]
    assert committed == [], "a killed job must not leave weights for its task"
    stale = time.time() - SWEEP_GRACE_SECONDS - 60  # the killed writer's temp files, once abandoned
    for p in store_root.rglob(".tmp-*"):
        os.utime(p, (stale, stale))
    DirectoryStore(store_root)  # reopening sweeps abandoned temp files of the killed writer
    assert not [p for p in store_root.rglob("*") if p.name.startswith(".tmp-")]
    with live_server(settings_for(tmp_path), backbone=tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=10) as c:
        after = c.get(f"/v1/jobs/{job['id']}").json()
        assert after["status"] == "failed" and after["error"]["type"] == "interrupted"
        task = c.get("/v1/tasks/doomed").json()
        assert task["status"] == "failed"
        # a failed task's id can be registered again
        again = c.post("/v1/tasks", json={"task": "doomed", "method": "routing", "examples": EXAMPLES, "steps": 3})
        assert again.status_code == 202


@pytest.mark.redis
@pytest.mark.skipif(not redis_up(), reason="needs the real Redis at 127.0.0.1:6379 (.ci/run starts it)")
def test_two_server_processes_share_store_and_redis(tmp_path):
    build_store(tmp_path / "store")
    redis_url = REDIS
    port = free_port()
    # the 1 s bounds below can only hold through Redis pub/sub: both re-scans are a minute apart
    other = serve_process(str(tmp_path / "store"), str(tmp_path), port, redis_url, {"POLYSERVE_RESCAN_SECONDS": "60"})
    try:
        with live_server(settings_for(tmp_path, redis_url=redis_url, redis_prefix=f"pstest{uuid.uuid4().hex[:8]}",
                                      rescan_seconds=60),
                         backbone=tiny_backbone()) as srv, \
                httpx.Client(base_url=srv.url, timeout=30) as a, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as b:
            wait_process_ready(other, f"http://127.0.0.1:{port}")
            job = a.post("/v1/tasks",
                         json={"task": "shared-task", "method": "routing", "examples": EXAMPLES, "steps": 5}).json()
            # visible through B at once (a loaded host may finish the 5 steps first: then it is ready)
            assert b.get("/v1/tasks/shared-task").json()["status"] in ("training", "ready")
            assert wait_job(a, job["id"])["status"] == "succeeded"
            assert b.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
            t0 = time.time()
            while b.get("/v1/tasks/shared-task").json()["status"] != "ready":
                assert time.time() - t0 < 1.0, "replica B did not see the new task within 1 s"
                time.sleep(0.02)
            ra, rb = generate(a, "shared-task"), generate(b, "shared-task")
            assert ra.status_code == rb.status_code == 200 and ra.json()["text"] == rb.json()["text"]
            l1 = srv.runtime.cache.l1
            assert any(":shared-task:" in k for k in l1.keys())  # noqa: SIM118 - L1Cache.keys() is a method; A materialised it
            assert b.delete("/v1/tasks/shared-task").status_code == 204
            t0 = time.time()
            while generate(a, "shared-task").status_code != 404:
                assert time.time() - t0 < 1.0, "replica A still serves a task deleted through B"
                time.sleep(0.02)
            # Only B's notification can make A drop the adapter it holds (A's re-scan is a minute away):
            t0 = time.time()
            while any(":shared-task:" in k for k in l1.keys()):  # noqa: SIM118
                assert time.time() - t0 < 1.0, "replica A still holds the deleted task's adapter after 1 s"
                time.sleep(0.02)
    finally:
        other.terminate()
        other.wait(20)


def test_a_job_no_worker_has_claimed_is_cancelled_at_once(tmp_path):
    """POLYSERVE_JOBS=off and no worker up: a cancel must not leave the job "queued" and its
    placeholder task "training" until a worker that may never come claims it."""
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, jobs="off"), backbone=tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        job = client.post("/v1/tasks", json={"task": "nobody-runs", "examples": EXAMPLES}).json()
        assert job["status"] == "queued" and client.get("/v1/tasks/nobody-runs").json()["status"] == "training"
        r = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "cancelled"
        assert client.get("/v1/tasks/nobody-runs").status_code == 404
        assert not DirectoryStore(tmp_path / "store").job_enqueued(job["id"])
        again = client.post("/v1/tasks", json={"task": "nobody-runs", "examples": EXAMPLES})
        assert again.status_code == 202, again.text  # the id is free again


def test_the_queued_jobs_limit_bounds_the_fleet_queue_when_workers_run_the_jobs(tmp_path):
    """POLYSERVE_JOBS=off: the replica runs nothing (its own count stays 0), so the limit must count
    the fleet's queue, or a client could fill the workers' backlog without end."""
    build_store(tmp_path / "store")
    with live_server(settings_for(tmp_path, jobs="off", max_queued_jobs=2), backbone=tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as client:
        ids = [client.post("/v1/tasks", json={"task": f"backlog-{i}", "examples": EXAMPLES}).json()["id"]
               for i in range(2)]
        full = client.post("/v1/tasks", json={"task": "backlog-2", "examples": EXAMPLES})
        assert full.status_code == 429 and full.headers["Retry-After"] == "30", full.text
        assert "fleet's queue" in full.json()["error"]["message"]
        assert client.get("/v1/tasks/backlog-2").status_code == 404  # nothing of it was written
        assert client.post(f"/v1/jobs/{ids[0]}/cancel").json()["status"] == "cancelled"
        assert client.post("/v1/tasks", json={"task": "backlog-2", "examples": EXAMPLES}).status_code == 202
