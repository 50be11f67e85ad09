"""Shipped tasks that say how well they do: each carries its measured exact match (held-out words;
sentences for a word-level task), shown by /v1/tasks, /v1/tasks/{task}, /v1/models and the client;
a task below the floor is not installed by default, and the opt-in installs it, marked."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from adapters_store.store.directory import DirectoryStore
from adapters_store.store.records import check_quality
from client import PolyserveClient, Quality
from server.wiring.runtime import _maybe_install_default_inventory, _refresh_shipped_tasks
from server.wiring.settings import Settings
from tests.support.server_fixtures import build_store, live_server, settings_for
from training.shipped_inventory import (
    OPT_IN_ENV,
    PACKAGE_DIR,
    QUALITY_FLOOR,
    install_default_inventory,
    refresh_shipped,
    shipped_records,
)
from training.suite import parse_task, takes_sentences

# held-out exact match of each packaged test task (None: never measured), sentences where word-level
FIGURES = {"rev-words": (0.875, 0.5), "title.sort": (QUALITY_FLOOR, 0.25), "caesar": (0.0, None),
           "inc.sum": (0.4375, None), "first2": (None, None)}
MEASURED = "2026-12-02"


def package(root: Path) -> DirectoryStore:
    """A package directory as training/default_inventory is laid out, its tasks' figures written in."""
    store = build_store(root, tasks=tuple(FIGURES))
    for task, (heldout, sentences) in FIGURES.items():
        path = store.root / "tasks" / task / "task.json"
        data = json.loads(path.read_text())
        data["source"] = {"kind": "pretraining"}
        if heldout is not None:
            data["quality"] = {"heldout_exact": heldout, "n": 16, "measured": MEASURED}
            if sentences is not None:
                data["quality"]["sentences_exact"] = sentences
        path.write_text(json.dumps(data))
    return store


def test_a_task_below_the_floor_is_not_installed_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    src = package(tmp_path / "package")
    store = DirectoryStore(tmp_path / "store")
    assert install_default_inventory(store, source=src.root)
    assert {r.id for r in store.list_tasks()} == {"rev-words", "title.sort", "first2"}  # at the floor: in
    rev = store.get_task("rev-words")
    assert rev.quality == {"heldout_exact": 0.875, "sentences_exact": 0.5, "n": 16, "measured": MEASURED}
    assert rev.digest == src.get_task("rev-words").digest and rev.description  # as shipped, described
    assert store.get_task("first2").quality == {}  # never measured: installed, with no figure


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_the_opt_in_installs_the_tasks_below_the_floor_marked(tmp_path, monkeypatch, how):
    src = package(tmp_path / "package")
    store = DirectoryStore(tmp_path / "store")
    if how == "environment":
        monkeypatch.setenv(OPT_IN_ENV, "1")
        assert install_default_inventory(store, source=src.root)
    else:
        monkeypatch.delenv(OPT_IN_ENV, raising=False)
        assert install_default_inventory(store, source=src.root, below_floor_too=True)
    assert {r.id for r in store.list_tasks()} == set(FIGURES)
    for task in ("caesar", "inc.sum"):
        quality = store.get_task(task).quality
        assert quality["below_floor"] is True and check_quality(quality) == quality
        assert quality["heldout_exact"] == FIGURES[task][0]
    assert "below_floor" not in store.get_task("rev-words").quality  # above the floor: no mark


def test_a_store_installed_before_the_figures_gets_them_and_keeps_its_tasks(tmp_path, monkeypatch):
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    src = package(tmp_path / "package")
    store = DirectoryStore(tmp_path / "store")
    store.import_inventory(*src.inventory_bytes())
    for record in src.list_tasks():  # as an older install wrote them: no description, no figures
        store.import_task(type(record).from_json({**record.to_json(), "quality": {}}), src.weights_bytes(record))
    before = store.get_task("caesar")
    assert refresh_shipped(store, source=src.root) == len(FIGURES) and refresh_shipped(store, source=src.root) == 0
    caesar = store.get_task("caesar")  # below the floor, already there: kept, and marked
    assert caesar.quality["below_floor"] is True and caesar.description
    assert (caesar.version, caesar.digest) == (before.version, before.digest)
    assert store.get_task("rev-words").quality["heldout_exact"] == 0.875


def test_the_opt_in_on_a_store_installed_with_the_floor_adds_the_tasks_below_it(tmp_path, monkeypatch):
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    src = package(tmp_path / "package")
    store = DirectoryStore(tmp_path / "store")
    install_default_inventory(store, source=src.root)
    assert refresh_shipped(store, source=src.root) == 0 and not store.has_task("caesar")  # no opt-in: none added
    assert refresh_shipped(store, source=src.root, below_floor_too=True) == 2
    assert store.get_task("caesar").quality["below_floor"] is True and store.has_task("inc.sum")


def test_the_setting_is_the_opt_in_for_the_server_and_workers(tmp_path, monkeypatch):
    """POLYSERVE_SHIPPED_BELOW_FLOOR reaches the install the server and the workers run, on the
    real package data."""
    monkeypatch.setenv(OPT_IN_ENV, "true")
    assert Settings(backbone="tiny", store=str(tmp_path / "unused")).shipped_below_floor is True
    monkeypatch.delenv(OPT_IN_ENV)
    shipped = shipped_records()
    weak = {t for t, r in shipped.items() if r.quality["heldout_exact"] < QUALITY_FLOOR}
    store = DirectoryStore(tmp_path / "store")
    assert _maybe_install_default_inventory(store, "default", below_floor_too=False)
    assert {r.id for r in store.list_tasks()} == set(shipped) - weak
    _refresh_shipped_tasks(store, "default", below_floor_too=True)
    assert {r.id for r in store.list_tasks()} == set(shipped)
    assert all(store.get_task(t).quality["below_floor"] is True for t in weak)


def test_every_shipped_task_carries_its_measured_quality():
    """The package data: every task measured on 16 held-out inputs, on sentences exactly where it
    is word-level; `caesar` and `rev-chars` (none right on held-out words) under the floor."""
    shipped = shipped_records(PACKAGE_DIR)
    assert len(shipped) >= 500
    for task, record in shipped.items():
        assert check_quality(record.quality) == record.quality and record.quality["n"] == 16, task
        assert ("sentences_exact" in record.quality) == takes_sentences(parse_task(task)), task
        assert "below_floor" not in record.quality  # the mark is the install's, not the package's
    assert all(shipped[t].quality["heldout_exact"] < QUALITY_FLOOR for t in ("caesar", "rev-chars"))
    assert all(shipped[t].quality["heldout_exact"] >= QUALITY_FLOOR for t in ("rev-words", "first2", "dedupe"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    src = package(root / "package")
    store = DirectoryStore(root / "store")
    install_default_inventory(store, source=src.root, below_floor_too=True)
    store.put_routing("mine", src.load_routing("first2"), method="routing")  # a registered task
    with live_server(settings_for(root, warmup=False)) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        yield srv, c


def test_the_api_shows_each_tasks_measured_quality(served):
    _, client = served
    listed = {t["id"]: t for t in client.get("/v1/tasks").json()["data"]}
    assert listed["rev-words"]["quality"] == {"heldout_exact": 0.875, "sentences_exact": 0.5, "n": 16,
                                              "measured": MEASURED, "below_floor": False}
    assert listed["caesar"]["quality"] == {"heldout_exact": 0.0, "sentences_exact": None, "n": 16,
                                           "measured": MEASURED, "below_floor": True}
    assert listed["mine"]["quality"] is None and listed["first2"]["quality"] is None  # never measured
    assert client.get("/v1/tasks/caesar").json()["quality"] == listed["caesar"]["quality"]
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["rev-words"]["quality"] == listed["rev-words"]["quality"] and models["base"]["quality"] is None
    assert client.get("/v1/models/caesar").json()["quality"]["below_floor"] is True


def test_the_client_reads_the_quality(served):
    srv, _ = served
    with PolyserveClient(srv.url) as c:
        assert c.get_task("rev-words").quality == Quality(heldout_exact=0.875, n=16, measured=MEASURED,
                                                          sentences_exact=0.5, below_floor=False)
        tasks = {t.id: t for t in c.list_tasks()}
        assert tasks["caesar"].quality == Quality(heldout_exact=0.0, n=16, measured=MEASURED, below_floor=True)
        assert tasks["mine"].quality is None
        assert {m.id: m.quality for m in c.list_models()}["inc.sum"].below_floor is True


@pytest.mark.parametrize("raw, want", [("1", True), ("yes", True), ("True", True), ("0", False), ("off", False),
                                       ("", False)])
def test_the_opt_in_reads_a_boolean_as_the_settings_do(monkeypatch, raw, want):
    from training.shipped_inventory import opted_in

    monkeypatch.setenv(OPT_IN_ENV, raw)
    assert opted_in() is want
    if raw:
        assert Settings().shipped_below_floor is want


def test_a_malformed_opt_in_is_refused_naming_the_variable(monkeypatch):
    from training.shipped_inventory import opted_in

    monkeypatch.setenv(OPT_IN_ENV, "maybe")
    with pytest.raises(ValueError, match=OPT_IN_ENV):
        opted_in()
