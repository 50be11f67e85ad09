"""Registration.delete against another replica's job, with the interleavings injected (no model)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from adapters_store.lora.spec import InventorySpec
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import TaskNotFound
from adapters_store.store.records import TaskRecord
from server.jobs.model import Job
from server.jobs.service import Registration

OTHER_JOB = Job(id="job-00000000000000aa", task="t", method="routing", steps=30, seed=0, n_examples=4,
                owner="replica-other")


@pytest.fixture
def here(tmp_path):
    """This replica's Registration over a store another replica shares (its job runs there)."""
    store = DirectoryStore(tmp_path / "store")
    store.save_inventory(InventorySpec(n_skills=2, n_heads=1, rank=1, target_modules=("q",)), ["m.q"], [(2, 2)],
                         {"m.q.A": torch.zeros(1, 2, 2, 1), "m.q.B": torch.zeros(1, 2, 1, 2)},
                         backbone_fingerprint="fp")
    forgotten: list[str] = []
    rt = SimpleNamespace(
        store=store, cache=None, l2=None, routed=object(),
        settings=SimpleNamespace(redis_url=None, job_retention_seconds=3600, rescan_seconds=1.0, jobs="local",
                                 api_keys=[], admin_keys=[]),
        metrics=SimpleNamespace(redis_errors=SimpleNamespace(inc=lambda: None)),
        registry=SimpleNamespace(forget=forgotten.append, isolated=False),
        engine=SimpleNamespace(forget=lambda task: None))
    store.put_job(OTHER_JOB.to_json() | {"status": "running"})
    store.put_record(TaskRecord(id="t", method="routing", status="training", version=0, created_at=0.0,
                                updated_at=0.0, job_id=OTHER_JOB.id))
    return Registration(rt), store, forgotten


def test_delete_wins_when_the_other_replicas_job_removes_its_placeholder_first(here):
    """The other replica's runner sees the cancel marker and removes the placeholder between this
    DELETE's read of the task and its removal: the DELETE still succeeds (it used to be a 404
    for a task that existed when it arrived) and the task is gone."""
    registration, store, forgotten = here
    other_replica = DirectoryStore(store.root)
    real_delete = store.delete_task

    def the_other_runner_lands_first(task):
        assert other_replica.cancel_requested(OTHER_JOB.id), "the DELETE must cancel the job before removing"
        other_replica.settle_placeholder(task, OTHER_JOB.id, error=None)
        return real_delete(task)

    store.delete_task = the_other_runner_lands_first
    registration.delete("t")
    assert not store.has_task("t")
    assert forgotten == ["t"]


def test_delete_of_a_missing_task_is_still_not_found(here):
    registration, store, _ = here
    store.delete_task("t")
    with pytest.raises(TaskNotFound):
        registration.delete("t")
