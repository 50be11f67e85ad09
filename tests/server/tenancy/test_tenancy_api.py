"""Tenants over HTTP (tiny model): task ownership (someone else's task, job and delete answer 404;
shared tasks work for everyone), tenants serving themselves beside admin keys (their own tasks,
jobs and usage rows; 403 on what only an admin may do), usage by tenant and task, metrics by
tenant name (never a key), and a tenant cap's 429 naming the limit."""

from __future__ import annotations

import time
from types import SimpleNamespace

import httpx
import pytest

from adapters_store.store.records import TaskRecord
from server.api import generation
from server.api.errors import ApiError
from server.engines.fair import TenantLimit
from server.engines.request import GenRequest, RequestHandle, SamplingParams
from server.infra.metrics import Metrics
from server.tenancy.tenants import Directory, parse_entry
from server.tenancy.usage import UsageLedger
from server.wiring.settings import Settings
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(6)]
ALICE, BOB, ROOT = "key-alice-7f3a", "key-bob-19c2", "key-root-55e0"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_job(c: httpx.Client, job_id: str, key: str) -> dict:
    deadline = time.time() + 120
    while time.time() < deadline:
        job = c.get(f"/v1/jobs/{job_id}", headers=auth(key)).json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(job_id)


# -- keys and names ------------------------------------------------------------------------------
def test_key_entries_name_tenants_with_weights():
    assert parse_entry("k1") == ("default", "k1", 1.0)
    assert parse_entry("team-a:k2") == ("team-a", "k2", 1.0)
    assert parse_entry("team-a:k2:2.5") == ("team-a", "k2", 2.5)
    d = Directory(["team-a:k2:2", "k1"], ["ops:k9"])
    assert d.lookup("k2").name == "team-a" and d.lookup("k1").name == "default" and d.lookup("k9").admin
    assert d.lookup("nope") is None and d.weights == {"team-a": 2.0, "default": 1.0, "ops": 1.0}


@pytest.mark.parametrize("entry,why", [("Bad Name:k", "must match"), ("a:k:0", "weight"), ("a:k:nan", "weight"),
                                       ("a:", "empty key"), ("a:k:1:x", "key, name:key")])
def test_a_bad_key_entry_fails_at_start_naming_the_tenant_not_the_key(entry, why):
    with pytest.raises(ValueError, match=why) as err:
        Settings(api_keys=entry)
    assert ":k:" not in str(err.value)


def test_one_name_two_weights_is_refused():
    with pytest.raises(ValueError, match="two different weights"):
        Directory(["a:k1:1", "a:k2:2"], [])


# -- ownership: tenants register their own tasks (only API keys: any key may register) --------------
@pytest.fixture(scope="module")
def owned(tmp_path_factory):
    root = tmp_path_factory.mktemp("owned")
    build_store(root / "store")
    settings = settings_for(root, api_keys=[f"alice:{ALICE}", f"bob:{BOB}"], warmup=False)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/tasks", json={"task": "alice-task", "examples": EXAMPLES, "method": "retrieve"},
                   headers=auth(ALICE))
        assert r.status_code == 202, r.text
        job = wait_job(c, r.json()["id"], ALICE)
        assert job["status"] == "succeeded", job
        yield srv, c, job


def test_another_tenants_task_is_absent_for_bob(owned):
    _, c, job = owned
    bob = auth(BOB)
    assert "alice-task" not in [t["id"] for t in c.get("/v1/tasks", headers=bob).json()["data"]]
    assert c.get("/v1/tasks/alice-task", headers=bob).status_code == 404
    r = c.post("/v1/generate", json={"task": "alice-task", "prompt": "w1 x1", "max_new_tokens": 4}, headers=bob)
    assert r.status_code == 404 and "alice-task" in r.json()["error"]["message"]
    r = c.post("/v1/completions", json={"model": "alice-task", "prompt": "hi", "max_tokens": 4}, headers=bob)
    assert r.status_code == 404
    assert c.get(f"/v1/jobs/{job['id']}", headers=bob).status_code == 404
    assert c.get(f"/v1/jobs/{job['id']}/events", headers=bob).status_code == 404
    assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=bob).status_code == 404
    assert c.delete("/v1/tasks/alice-task", headers=bob).status_code == 404
    # and nothing happened to it: alice still has it all
    alice = auth(ALICE)
    assert "alice-task" in [t["id"] for t in c.get("/v1/tasks", headers=alice).json()["data"]]
    assert c.get(f"/v1/jobs/{job['id']}", headers=alice).json()["status"] == "succeeded"
    r = c.post("/v1/generate", json={"task": "alice-task", "prompt": "w1 x1", "max_new_tokens": 4}, headers=alice)
    assert r.status_code == 200, r.text


def test_another_tenants_task_is_absent_from_models_similar_and_tokenize(owned):
    """The OpenAI model list and lookup, task search and vLLM's utility routes see ownership too:
    bob neither finds alice's task nor learns its id from another task's neighbours."""
    _, c, _ = owned
    bob, alice = auth(BOB), auth(ALICE)
    assert "alice-task" not in [m["id"] for m in c.get("/v1/models", headers=bob).json()["data"]]
    assert "alice-task" in [m["id"] for m in c.get("/v1/models", headers=alice).json()["data"]]
    assert c.get("/v1/models/alice-task", headers=bob).status_code == 404
    assert c.get("/v1/models/alice-task", headers=alice).status_code == 200
    assert c.get("/v1/tasks/alice-task/similar", headers=bob).status_code == 404
    def neighbours(key: str) -> list[str]:
        near = c.get("/v1/tasks/alpha/similar?k=100", headers=auth(key))
        assert near.status_code == 200, near.text
        return [t["id"] for t in near.json()["data"]]

    deadline = time.time() + 10  # the index re-reads the store at most once a second
    while "alice-task" not in neighbours(ALICE):
        assert time.time() < deadline, "alice never found her own task among alpha's neighbours"
        time.sleep(0.2)
    assert "alice-task" not in neighbours(BOB)  # the same, fresh index: hidden, not stale
    assert c.post("/tokenize", json={"model": "alice-task", "prompt": "hi"}, headers=bob).status_code == 404
    assert c.post("/tokenize", json={"model": "alice-task", "prompt": "hi"}, headers=alice).status_code == 200


def test_shipped_tasks_are_shared_by_everyone(owned):
    _, c, _ = owned
    for key in (ALICE, BOB):
        assert {"alpha", "beta"} <= {t["id"] for t in c.get("/v1/tasks", headers=auth(key)).json()["data"]}
        r = c.post("/v1/generate", json={"task": "alpha", "prompt": "w1 x1", "max_new_tokens": 4}, headers=auth(key))
        assert r.status_code == 200, r.text


def test_only_an_admin_may_share_a_task(owned):
    _, c, _ = owned
    r = c.post("/v1/tasks", json={"task": "mine", "examples": EXAMPLES, "method": "retrieve", "shared": True},
               headers=auth(ALICE))
    assert r.status_code == 403 and r.json()["error"]["param"] == "shared"


def test_the_owner_deletes_its_own_task(owned):
    srv, c, _ = owned
    r = c.post("/v1/tasks", json={"task": "bob-task", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(BOB))
    wait_job(c, r.json()["id"], BOB)
    assert srv.runtime.store.get_task("bob-task").owner == "bob"
    assert c.delete("/v1/tasks/bob-task", headers=auth(ALICE)).status_code == 404
    assert c.delete("/v1/tasks/bob-task", headers=auth(BOB)).status_code == 204


def test_metrics_name_tenants_never_keys(owned):
    _, c, _ = owned
    c.post("/v1/generate", json={"task": "alpha", "prompt": "w1 x1", "max_new_tokens": 3}, headers=auth(BOB))
    text = c.get("/metrics").text
    assert 'tenant="bob"' in text and 'tenant="alice"' in text
    assert ALICE not in text and BOB not in text
    assert any(line.startswith("polyserve_generation_tokens_total{tenant=\"bob\"}") for line in text.splitlines())


# -- shared tasks and usage: admins register, tenants use --------------------------------------------
@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("admin")
    build_store(root / "store")
    settings = settings_for(root, api_keys=[f"alice:{ALICE}", f"bob:{BOB}"], admin_keys=[f"root:{ROOT}"],
                            warmup=False)
    with live_server(settings, tiny_backbone()) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        for task, shared in (("common", True), ("roots-own", False)):
            r = c.post("/v1/tasks", json={"task": task, "examples": EXAMPLES, "method": "retrieve", "shared": shared},
                       headers=auth(ROOT))
            assert r.status_code == 202, r.text
            assert wait_job(c, r.json()["id"], ROOT)["status"] == "succeeded"
        yield srv, c


def test_an_admins_shared_task_works_for_every_tenant_and_its_own_for_none(admin_server):
    _, c = admin_server
    for key in (ALICE, BOB):
        ids = {t["id"] for t in c.get("/v1/tasks", headers=auth(key)).json()["data"]}
        assert "common" in ids and "roots-own" not in ids
        r = c.post("/v1/generate", json={"task": "common", "prompt": "w1 x1", "max_new_tokens": 4}, headers=auth(key))
        assert r.status_code == 200, r.text
        r = c.post("/v1/generate", json={"task": "roots-own", "prompt": "w1", "max_new_tokens": 4}, headers=auth(key))
        assert r.status_code == 404
    assert {"common", "roots-own"} <= {t["id"] for t in c.get("/v1/tasks", headers=auth(ROOT)).json()["data"]}


def test_usage_by_tenant_and_task_an_admin_sees_all_a_tenant_its_own(admin_server):
    _, c = admin_server
    for key, n in ((ALICE, 2), (BOB, 1)):
        for _ in range(n):
            r = c.post("/v1/generate", json={"task": "alpha", "prompt": "w1 x1", "max_new_tokens": 5},
                       headers=auth(key))
            assert r.status_code == 200
    assert c.get("/v1/usage?window=0", headers=auth(ROOT)).status_code == 422
    assert c.get("/v1/usage?window=99999999", headers=auth(ROOT)).status_code == 422
    rows = c.get("/v1/usage?window=600", headers=auth(ROOT)).json()["data"]
    assert {"alice", "bob"} <= {r["tenant"] for r in rows}
    row = next(r for r in rows if r["tenant"] == "alice" and r["task"] == "alpha")
    assert row["requests"] >= 2 and row["prompt_tokens"] > 0 and row["refused"] == 0
    assert 2 <= row["completion_tokens"] <= 10 * row["requests"]
    assert set(row) == {"tenant", "task", "requests", "prompt_tokens", "completion_tokens", "refused"}
    for key, name in ((ALICE, "alice"), (BOB, "bob")):
        r = c.get("/v1/usage?window=600", headers=auth(key))
        assert r.status_code == 200, r.text
        own = r.json()["data"]
        assert own and {x["tenant"] for x in own} == {name}, own
        assert {x["task"] for x in own} == {x["task"] for x in rows if x["tenant"] == name}
    assert c.get("/v1/usage?window=99999999", headers=auth(ALICE)).status_code == 422


def test_a_tenant_serves_itself_beside_admin_keys(admin_server):
    """Both kinds of key set: alice registers, uses, cancels and deletes her own task; bob gets 404
    on every bit of it; alice gets 403 on what only an admin may do and 404 on the admin's own task."""
    srv, c = admin_server
    alice, bob, root = auth(ALICE), auth(BOB), auth(ROOT)
    r = c.post("/v1/tasks", json={"task": "alice-self", "examples": EXAMPLES, "method": "retrieve"}, headers=alice)
    assert r.status_code == 202, r.text
    job = wait_job(c, r.json()["id"], ALICE)
    assert job["status"] == "succeeded" and srv.runtime.store.get_task("alice-self").owner == "alice"
    body = {"task": "alice-self", "prompt": "w1 x1", "max_new_tokens": 4}
    assert c.post("/v1/generate", json=body, headers=alice).status_code == 200
    assert c.get("/v1/tasks/alice-self", headers=alice).status_code == 200
    # a long job of hers: bob cannot see or cancel it, she can
    r = c.post("/v1/tasks", json={"task": "alice-long", "method": "routing", "examples": EXAMPLES, "steps": 5000},
               headers=alice)
    assert r.status_code == 202, r.text
    long_job = r.json()["id"]
    for method, path in (("GET", "/v1/tasks/alice-self"), ("GET", f"/v1/jobs/{job['id']}"),
                         ("GET", f"/v1/jobs/{job['id']}/events"), ("GET", f"/v1/jobs/{long_job}"),
                         ("POST", f"/v1/jobs/{long_job}/cancel"), ("DELETE", "/v1/tasks/alice-self"),
                         ("DELETE", "/v1/tasks/alice-long")):
        assert c.request(method, path, headers=bob).status_code == 404, (method, path)
    assert c.post("/v1/generate", json=body, headers=bob).status_code == 404
    assert "alice-self" not in {t["id"] for t in c.get("/v1/tasks", headers=bob).json()["data"]}
    r = c.post(f"/v1/jobs/{long_job}/cancel", headers=alice)
    assert r.status_code == 200, r.text  # running: it stops at its next slice
    assert wait_job(c, long_job, ALICE)["status"] == "cancelled"
    assert c.delete("/v1/tasks/alice-self", headers=alice).status_code == 204
    assert c.get("/v1/tasks/alice-self", headers=alice).status_code == 404
    assert c.post("/v1/generate", json=body, headers=alice).status_code == 404
    # what only an admin may do
    r = c.post("/v1/tasks", json={"task": "alice-shared", "examples": EXAMPLES, "method": "retrieve", "shared": True},
               headers=alice)
    assert r.status_code == 403 and r.json()["error"]["param"] == "shared", r.text
    assert c.get("/v1/tasks/alice-shared", headers=alice).status_code == 404  # nothing of it was written
    r = c.delete("/v1/tasks/common", headers=alice)  # shared: she uses it, an admin changes it
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"], r.text
    for method, path in (("GET", "/v1/tasks/roots-own"), ("DELETE", "/v1/tasks/roots-own")):
        assert c.request(method, path, headers=alice).status_code == 404, (method, path)
    assert c.get("/v1/tasks/common", headers=alice).status_code == 200  # untouched
    # an admin changes anyone's task
    r = c.post("/v1/tasks", json={"task": "alice-again", "examples": EXAMPLES, "method": "retrieve"}, headers=alice)
    wait_job(c, r.json()["id"], ALICE)
    assert c.delete("/v1/tasks/alice-again", headers=root).status_code == 204
    assert c.get("/v1/tasks/alice-again", headers=alice).status_code == 404


def test_only_an_admin_imports_a_lora_once_admin_keys_exist(admin_server):
    from tests.adapters_store.interop.test_lora_import import peft_lora, upload

    srv, c = admin_server
    info = srv.runtime.store.inventory_info()
    cfg, tensors = peft_lora(info, r=2, alpha=2.0)
    r = c.post("/v1/tasks", json=upload(info, cfg, tensors, "alice-import"), headers=auth(ALICE))
    assert r.status_code == 403 and r.json()["error"]["param"] == "method", r.text
    assert not srv.runtime.store.has_task("alice-import")
    r = c.post("/v1/tasks", json=upload(info, cfg, tensors, "root-import"), headers=auth(ROOT))
    assert r.status_code == 201, r.text
    assert c.delete("/v1/tasks/root-import", headers=auth(ROOT)).status_code == 204


def test_someone_elses_failed_task_is_not_replaced(admin_server):
    """A failed task's id may be registered again, by its owner (or an admin) only."""
    import dataclasses

    srv, c = admin_server
    r = c.post("/v1/tasks", json={"task": "bob-failed", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(BOB))
    wait_job(c, r.json()["id"], BOB)
    store = srv.runtime.store
    store.put_record(dataclasses.replace(store.get_task("bob-failed"), status="failed", error="made to fail"))
    r = c.post("/v1/tasks", json={"task": "bob-failed", "examples": EXAMPLES, "method": "retrieve"},
               headers=auth(ALICE))
    assert r.status_code == 409, r.text
    assert store.get_task("bob-failed").owner == "bob"
    r = c.post("/v1/tasks", json={"task": "bob-failed", "examples": EXAMPLES, "method": "retrieve"}, headers=auth(BOB))
    assert r.status_code == 202, r.text
    wait_job(c, r.json()["id"], BOB)
    assert c.delete("/v1/tasks/bob-failed", headers=auth(BOB)).status_code == 204


# -- the answer to a tenant cap ------------------------------------------------------------------
class RefusingEngine:
    def __init__(self, err: Exception) -> None:
        self.err = err

    def submit(self, req):
        raise self.err


def call() -> generation.Call:
    req = GenRequest([1, 2], SamplingParams(), task="alpha", tenant="bob", handle=RequestHandle(None))
    return generation.Call(req, 0.0, "", {})


def test_a_tenant_cap_answers_429_naming_the_limit_and_counts_the_refusal():
    metrics, usage = Metrics(), UsageLedger()
    rt = SimpleNamespace(engine=RefusingEngine(TenantLimit("bob", "queued", "bob has 4 waiting", retry_after=7)),
                         metrics=metrics, usage=usage)
    with pytest.raises(ApiError) as err:
        generation.submit(rt, call())  # type: ignore[arg-type]
    assert err.value.status == 429 and err.value.headers == {"Retry-After": "7"}
    assert "queued limit" in err.value.message
    assert metrics.tenant_refused.labels(tenant="bob", limit="queued")._value.get() == 1
    assert usage.rows(60)[0] | {} == {"tenant": "bob", "task": "alpha", "requests": 0, "prompt_tokens": 0,
                                      "completion_tokens": 0, "refused": 1}
    rt.engine = RefusingEngine(TenantLimit("bob", "rows", "n: 8 choices exceed", permanent=True))
    with pytest.raises(ApiError) as err:
        generation.submit(rt, call())  # type: ignore[arg-type]
    assert err.value.status == 422 and err.value.param == "n"


def test_usage_keeps_a_bounded_window():
    now = [10_000.0]
    ledger = UsageLedger(keep_seconds=300, clock=lambda: now[0])
    ledger.request("a", "t", 5)
    now[0] += 120
    ledger.completion("a", "t", 7)
    assert ledger.rows(60) == [{"tenant": "a", "task": "t", "requests": 0, "prompt_tokens": 0,
                                "completion_tokens": 7, "refused": 0}]
    assert ledger.rows(300)[0]["requests"] == 1
    now[0] += 600
    ledger.refused("a", "t")  # older buckets fall out of the kept window
    assert len(ledger._buckets) == 1 and ledger.rows(10_000)[0]["completion_tokens"] == 0


def test_a_record_without_owner_reads_as_shared():
    record = TaskRecord.from_json({"id": "old", "method": "mhr", "status": "ready", "version": 1,
                                   "created_at": 0.0, "updated_at": 0.0})
    assert record.owner is None and not record.shared


def test_an_imported_lora_belongs_to_its_importer(owned):
    """POST /v1/tasks with method lora records the caller as the owner, like a registration:
    another tenant neither sees nor uses it."""
    from tests.adapters_store.interop.test_lora_import import peft_lora, upload

    srv, c, _ = owned
    info = srv.runtime.store.inventory_info()
    cfg, tensors = peft_lora(info, r=2, alpha=2.0)
    r = c.post("/v1/tasks", json=upload(info, cfg, tensors, "alice-lora"), headers=auth(ALICE))
    assert r.status_code == 201, r.text
    assert srv.runtime.store.get_task("alice-lora").owner == "alice"
    body = {"task": "alice-lora", "prompt": "w1 x1", "max_new_tokens": 4}
    assert c.post("/v1/generate", json=body, headers=auth(BOB)).status_code == 404
    assert c.get("/v1/tasks/alice-lora", headers=auth(BOB)).status_code == 404
    assert c.post("/v1/generate", json=body, headers=auth(ALICE)).status_code == 200
