"""Tasks that say what they are: a registration's `description` and first examples are kept on
its record (through its versions) and shown by /v1/tasks, /v1/tasks/{task} and /v1/models;
GET /v1/tasks?search= filters on them; shipped tasks get the suite's definitions, on install and
in a store installed before records carried them."""

from __future__ import annotations

import time

import httpx
import pytest
import torch

from adapters_store.store.directory import DirectoryStore
from adapters_store.store.records import MAX_DESCRIPTION_CHARS, MAX_RECORD_EXAMPLES
from tests.support.server_fixtures import build_store, live_server, settings_for, tiny_backbone
from training.shipped_inventory import install_default_inventory, refresh_shipped, suite_description
from training.suite import parse_task

EXAMPLES = [{"input": f"w{i} x{i}", "output": f"x{i} w{i}"} for i in range(8)]
SAID = "Swap the two words of the input."


def wait_job(client: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise TimeoutError(job_id)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("described")
    store = build_store(root / "store")
    with live_server(settings_for(root, warmup=False), tiny_backbone()) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c:
        job = c.post("/v1/tasks", json={"task": "swap-said", "examples": EXAMPLES, "steps": 3, "seed": 0,
                                        "description": f"  {SAID}  "}).json()
        placeholder = c.get("/v1/tasks/swap-said").json()
        done = wait_job(c, job["id"])
        assert done["status"] == "succeeded", done
        yield c, store, placeholder


def test_a_registration_keeps_its_description_and_first_examples(served):
    client, store, placeholder = served
    assert placeholder["description"] == SAID  # already while it trains
    task = client.get("/v1/tasks/swap-said").json()
    assert task["status"] == "ready" and task["description"] == SAID
    assert task["examples"] == EXAMPLES[:MAX_RECORD_EXAMPLES]
    record = store.get_task("swap-said")  # on the record itself, the trained version's
    assert record.version >= 1 and record.description == SAID and record.examples == EXAMPLES[:MAX_RECORD_EXAMPLES]
    listed = {t["id"]: t for t in client.get("/v1/tasks").json()["data"]}
    assert listed["swap-said"]["description"] == SAID and listed["alpha"]["description"] is None
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["swap-said"]["description"] == SAID
    assert client.get("/v1/models/swap-said").json()["description"] == SAID


@pytest.mark.parametrize(("search", "found"), [
    ("swap", {"swap-said"}),
    ("TWO words", {"swap-said"}),  # every word, any case, in the id or the description
    ("words alpha", set()),
    ("alp", {"alpha"}),
    ("   ", None),  # blank: no filter
])
def test_search_filters_tasks(served, search, found):
    client, _, _ = served
    ids = {t["id"] for t in client.get("/v1/tasks", params={"search": search}).json()["data"]}
    if found is None:
        assert ids == {t["id"] for t in client.get("/v1/tasks").json()["data"]}
    else:
        assert ids == found


def test_a_search_too_long_is_422_naming_it(served):
    client, _, _ = served
    r = client.get("/v1/tasks", params={"search": "x" * 201})
    assert r.status_code == 422 and r.json()["error"]["param"] == "search"


@pytest.mark.parametrize("description", ["", "   ", "x" * (MAX_DESCRIPTION_CHARS + 1), 7])
def test_a_bad_description_is_422_naming_it_and_stores_nothing(served, description):
    client, store, _ = served
    jobs = len(store.list_jobs())
    r = client.post("/v1/tasks", json={"task": "bad-said", "examples": EXAMPLES, "description": description})
    assert r.status_code == 422 and r.json()["error"]["param"] == "description", r.text
    assert client.get("/v1/tasks/bad-said").status_code == 404 and len(store.list_jobs()) == jobs


def test_shipped_tasks_are_described_on_install(tmp_path):
    package = build_store(tmp_path / "package", tasks=("rev-words", "caesar.upper", "alpha"))
    target = DirectoryStore(tmp_path / "store")
    assert install_default_inventory(target, source=package.root)
    for task in ("rev-words", "caesar.upper"):
        record = target.get_task(task)
        assert record.description == suite_description(task) and record.description.endswith(".")
        assert len(record.examples) == MAX_RECORD_EXAMPLES
        assert all(parse_task(task).apply(e["input"]) == e["output"] for e in record.examples)
        assert record.digest == package.get_task(task).digest  # the same weights, as shipped
    assert target.get_task("alpha").description is None  # no suite definition: none made up
    assert suite_description("caesar.upper") == "Shift every letter by one (z wraps to a), keeping case; then " \
        "uppercase every letter."


def test_a_store_installed_without_descriptions_gets_them_once(tmp_path):
    store = build_store(tmp_path / "store", tasks=("alpha",))
    info = store.inventory_info()
    shape = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
    for task in ("rev-words", "title.sort"):
        store.put_routing(task, torch.ones(shape), method="mhr", source={"kind": "pretraining"})
    store.put_routing("count", torch.ones(shape), method="routing")  # registered, not shipped: left alone
    before = store.get_task("rev-words")
    assert refresh_shipped(store) == 2 and refresh_shipped(store) == 0
    after = store.get_task("rev-words")
    assert after.description == suite_description("rev-words") and after.examples
    assert (after.version, after.digest) == (before.version, before.digest)
    assert torch.equal(store.load_routing("rev-words"), torch.ones(shape))
    assert store.get_task("count").description is None and store.get_task("alpha").description is None
