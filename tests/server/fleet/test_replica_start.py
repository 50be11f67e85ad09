"""Replicas starting together on one store: both prune and recover at once, and neither may fail
its start-up over a job file the other removed between listing and reading it (one replica used
to stay unready for good), nor over an unreadable job record."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import adapters_store.store.directory as store_module
from adapters_store.store.directory import DirectoryStore
from server.jobs.model import Job
from server.jobs.service import Registration
from tests.support.server_fixtures import build_store


def finished_job(i: int, age: float) -> dict:
    job = Job(id=f"job-{i:016x}", task=f"t{i}", method="routing")
    job.transition("running")
    job.transition("succeeded")
    data = job.to_json()
    data["finished_at"] = time.time() - age
    return data


def test_a_job_pruned_between_listing_and_reading_is_skipped(tmp_path, monkeypatch):
    store = DirectoryStore(tmp_path / "store")
    for i in range(3):
        store.put_job(finished_job(i, age=0))
    real = store_module.read_json

    def pruned_meanwhile(path):
        if path.name == "job-0000000000000001.json":
            path.unlink()  # the other replica's prune wins the race
        return real(path)

    monkeypatch.setattr(store_module, "read_json", pruned_meanwhile)
    assert [j["id"] for j in store.list_jobs()] == ["job-0000000000000000", "job-0000000000000002"]


def test_an_unreadable_job_record_does_not_stop_listing(tmp_path):
    store = DirectoryStore(tmp_path / "store")
    store.put_job(finished_job(0, age=0))
    (store.root / "jobs" / "job-00000000000000ff.json").write_text("{not json")
    (store.root / "jobs" / "job-00000000000000fe.json").write_text("[1, 2]")
    assert [j["id"] for j in store.list_jobs()] == ["job-0000000000000000"]


def replica(store: DirectoryStore) -> Registration:
    rt = SimpleNamespace(
        store=store, cache=None, l2=None, routed=object(),
        settings=SimpleNamespace(redis_url=None, job_retention_seconds=3600, rescan_seconds=60.0, jobs="local",
                                 api_keys=[], admin_keys=[]),
        metrics=SimpleNamespace(redis_errors=SimpleNamespace(inc=lambda: None)),
        registry=SimpleNamespace(forget=lambda task: None, isolated=False),
        engine=SimpleNamespace(forget=lambda task: None))
    return Registration(rt, rescan_every=60.0)


@pytest.mark.parametrize("round_", range(3))
def test_two_replicas_starting_together_both_start(tmp_path, round_):
    store = build_store(tmp_path / "store", tasks=("kept",))
    for i in range(300):  # old finished jobs: both replicas prune them at once
        store.put_job(finished_job(i, age=7200))
    (store.root / "jobs" / "job-00000000000000ff.json").write_text("{not json")
    a, b = replica(DirectoryStore(store.root)), replica(DirectoryStore(store.root))
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def start(r: Registration) -> None:
        barrier.wait()
        try:
            r.start()
        except BaseException as err:  # noqa: BLE001 - the test reports it
            errors.append(err)

    threads = [threading.Thread(target=start, args=(r,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    a.close()
    b.close()
    assert not errors, errors
    assert [j["id"] for j in store.list_jobs()] == []  # all pruned (the unreadable one is left alone)
