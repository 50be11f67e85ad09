"""Bounded registration work: a cap on steps (422 naming `steps`, stated in the OpenAPI document),
a cap on queued jobs per replica (429 with Retry-After), and retention of finished jobs. Other
bounds the server enforces stated in the document too: GET /v1/usage `window`, a LoRA's `adapter`."""

from __future__ import annotations

import time

import httpx
import pytest

from adapters_store.store.directory import DirectoryStore
from server.jobs.model import Job
from tests.server.jobs.test_registration_api import EXAMPLES
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone


@pytest.fixture
def bounded(tmp_path):
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, max_job_steps=300, max_queued_jobs=2)
    with live_server(settings, backbone=tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c


def test_steps_above_the_setting_are_422_and_documented(bounded):
    r = bounded.post("/v1/tasks", json={"task": "greedy", "method": "routing", "examples": EXAMPLES, "steps": 301})
    assert r.status_code == 422 and r.json()["error"]["param"] == "steps"
    assert bounded.get("/v1/tasks/greedy").status_code == 404  # nothing was created
    steps = bounded.get("/openapi.json").json()["components"]["schemas"]["RegisterRequest"]["properties"]["steps"]
    assert [b.get("maximum") for b in steps["anyOf"] if b.get("type") == "integer"] == [300]
    fine = bounded.post("/v1/tasks", json={"task": "fine", "method": "routing", "examples": EXAMPLES, "steps": 300})
    assert fine.status_code == 202


def test_the_usage_window_bound_is_documented_and_the_default_fits_under_it(tmp_path):
    build_store(tmp_path / "store")
    settings = settings_for(tmp_path, usage_window_max_seconds=120, warmup=False)
    with live_server(settings, backbone=tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        (param,) = c.get("/openapi.json").json()["paths"]["/v1/usage"]["get"]["parameters"]
        assert param["name"] == "window" and param["schema"]["maximum"] == 120 and param["schema"]["default"] == 120
        assert c.get("/v1/usage").status_code == 200  # the default hour, lowered to what is kept
        assert c.get("/v1/usage?window=120").status_code == 200
        r = c.get("/v1/usage?window=121")
        assert r.status_code == 422 and r.json()["error"]["param"] == "window"


def test_a_lora_adapter_is_documented_as_padded_base64(bounded):
    schema = bounded.get("/openapi.json").json()["components"]["schemas"]["RegisterRequest"]
    adapter = schema["properties"]["adapter"]
    (text,) = [b for b in adapter["anyOf"] if b.get("type") == "string"]
    assert text["minLength"] == 4 and adapter["contentEncoding"] == "base64"
    body = {"task": "mine", "method": "lora", "adapter_config": {}}
    for bad in ("", "AAA", "AA=A", "A*==", "QUFB\n"):  # schema-invalid: refused as shape, naming adapter
        r = bounded.post("/v1/tasks", json={**body, "adapter": bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == "adapter", (bad, r.text)
    # schema-valid bytes that are no LoRA: the semantic refusal, with its own code
    r = bounded.post("/v1/tasks", json={**body, "adapter": "QUFB", "adapter_config": {"r": 2}})
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_adapter", r.text


def test_queued_jobs_beyond_the_setting_are_429(bounded):
    codes = [bounded.post("/v1/tasks", json={"task": f"q{i}", "examples": EXAMPLES, "steps": 300}) for i in range(3)]
    assert [r.status_code for r in codes] == [202, 202, 429]
    assert int(codes[2].headers["Retry-After"]) >= 1
    assert bounded.get("/v1/tasks/q2").status_code == 404
    for r in codes[:2]:
        bounded.post(f"/v1/jobs/{r.json()['id']}/cancel")
    deadline = time.time() + 20
    q3 = {"task": "q3", "method": "routing", "examples": EXAMPLES, "steps": 2}
    while bounded.post("/v1/tasks", json=q3).status_code == 429:
        assert time.time() < deadline, "the queue never freed up after cancelling"
        time.sleep(0.1)


def test_prune_removes_old_finished_jobs_and_their_files_only(tmp_path):
    store = DirectoryStore(tmp_path / "s")
    now = time.time()
    jobs = {
        "job-old0000001": Job(id="job-old0000001", task="a", method="routing", status="succeeded",
                              finished_at=now - 100),
        "job-new0000001": Job(id="job-new0000001", task="b", method="routing", status="failed", finished_at=now - 1),
        "job-run0000001": Job(id="job-run0000001", task="c", method="routing", status="running"),
    }
    for job_id, job in jobs.items():
        store.put_job(job.to_json())
        store.put_job_examples(job_id, EXAMPLES)
        store.request_cancel(job_id)
    assert store.prune_jobs(older_than=now - 10) == 1
    assert sorted(j["id"] for j in store.list_jobs()) == ["job-new0000001", "job-run0000001"]
    assert not (store.root / "jobs" / "examples" / "job-old0000001.json").exists()
    assert not store.cancel_requested("job-old0000001") and store.cancel_requested("job-run0000001")
    assert store.get_job_examples("job-new0000001") == EXAMPLES
    assert store.prune_jobs(older_than=now + 10) == 1  # the running one is never pruned
    assert [j["id"] for j in store.list_jobs()] == ["job-run0000001"]
