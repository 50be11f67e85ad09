"""The store contract, run against every backend: the directory store and the PostgreSQL store
(a fresh database on the real server per test). Backend-specific behaviour (files, fcntl, temp
sweeps; schema migrations) is tested in test_directory.py and tests/integration/postgres/test_pg_store.py."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save as st_save
from torch.testing import assert_close

from adapters_store.lora.spec import InventorySpec
from adapters_store.store import open_store
from adapters_store.store.contract import AdapterStore
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import FingerprintMismatch, JobNotFound, StoreError, TaskNotFound
from adapters_store.store.records import TaskRecord
from tests.support.pg_utils import temp_database

NAMES = ["m.layers.0.q_proj", "m.layers.0.v_proj"]
DIMS = [(8, 8), (8, 4)]
SPEC = InventorySpec(n_skills=3, n_heads=2, rank=2, target_modules=("q_proj", "v_proj"))


def skills(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (d_in, d_out) in zip(NAMES, DIMS, strict=True):
        out[f"{name}.A"] = torch.randn(2, 3, d_in // 2, 2, generator=g)
        out[f"{name}.B"] = torch.randn(2, 3, 2, d_out // 2, generator=g)
    return out


@pytest.fixture(params=["directory", "postgresql"])
def location(request, tmp_path):
    """Where a store lives: a directory, or the DSN of a fresh database."""
    if request.param == "directory":
        yield str(tmp_path / "store")
    else:
        with temp_database() as dsn:
            yield dsn


@pytest.fixture
def empty(location, tmp_path) -> AdapterStore:
    store = open_store(location, cache_dir=tmp_path / "node-cache")
    yield store
    close = getattr(store, "close", None)
    if close:
        close()


@pytest.fixture
def store(empty) -> AdapterStore:
    empty.save_inventory(SPEC, NAMES, DIMS, skills(), backbone_fingerprint="llama-abc", backbone_name="tiny")
    return empty


def test_inventory_round_trip_and_fingerprint(store):
    info, tensors = store.load_inventory("llama-abc")
    assert info.spec == SPEC and info.layer_names == tuple(NAMES) and info.layer_dims == tuple(DIMS)
    for key, value in skills().items():
        assert torch.equal(tensors[key], value)
    with pytest.raises(FingerprintMismatch, match="llama-abc.*llama-other"):
        store.load_inventory("llama-other")


def test_no_inventory_is_a_clear_error(empty):
    assert not empty.has_inventory()
    with pytest.raises(StoreError, match="no skill inventory"):
        empty.inventory_info()


def test_a_new_inventory_replaces_the_old_and_import_checks_its_digest(store):
    new = store.save_inventory(SPEC, NAMES, DIMS, skills(1), backbone_fingerprint="llama-abc")
    assert store.inventory_info().version == new.version
    assert torch.equal(store.load_inventory()[1][f"{NAMES[0]}.A"], skills(1)[f"{NAMES[0]}.A"])
    with pytest.raises(StoreError, match="do not match"):
        store.import_inventory(new, st_save(skills(2)))
    assert store.inventory_info().version == new.version


def test_routing_versions_and_shape(store):
    logits = torch.randn(2, 2, 3)
    rec = store.put_routing("t1", logits, method="mhr", source={"how": "test"})
    assert rec.version == 1 and rec.status == "ready" and rec.params == 12
    assert rec.inventory_version == store.inventory_info().version
    assert_close(store.load_routing("t1"), logits)
    rec2 = store.put_routing("t1", logits + 1)
    assert rec2.version == 2 and rec2.cache_version != rec.cache_version and rec2.created_at == rec.created_at
    assert_close(store.load_routing("t1"), logits + 1)
    assert store.get_task("t1") == rec2
    with pytest.raises(StoreError, match="shape"):
        store.put_routing("t1", torch.randn(2, 2, 4))
    assert store.get_task("t1").version == 2


def test_plain_lora_and_kinds(store):
    lora = {"x.A": torch.randn(8, 2), "x.B": torch.randn(2, 8)}
    rec = store.put_lora("c", lora, method="full")
    assert rec.kind == "lora" and rec.params == 32
    loaded = store.load_weights(rec)
    assert all(torch.equal(loaded[k], v) for k, v in lora.items())
    with pytest.raises(StoreError, match="not a routing row"):
        store.load_routing("c")


def test_writing_one_task_leaves_the_others_identical(store):
    store.put_routing("a", torch.randn(2, 2, 3))
    before = store.get_task("a"), store.load_routing("a")
    store.put_routing("b", torch.randn(2, 2, 3))
    store.put_lora("c", {"x.A": torch.randn(8, 2), "x.B": torch.randn(2, 8)}, method="full")
    store.delete_task("b")
    assert store.get_task("a") == before[0] and torch.equal(store.load_routing("a"), before[1])
    assert [r.id for r in store.list_tasks()] == ["a", "c"]


def test_get_tasks_reads_the_named_records_that_exist(store):
    """What a listing's snapshot re-reads (adapters_store/store/snapshot.py): the same records as
    get_task, absent ids left out, whatever the order asked."""
    for task in ("a", "b", "c"):
        store.put_routing(task, torch.randn(2, 2, 3))
    got = store.get_tasks(["c", "gone", "a"])
    assert got == {"a": store.get_task("a"), "c": store.get_task("c")}
    assert store.get_tasks([]) == {}


@pytest.mark.parametrize("bad", ["../x", "", "a" * 65, "Upper", "a/b", "..", "x\n", "x'; DROP TABLE tasks; --"])
def test_bad_task_ids_are_refused_everywhere(store, bad):
    for call in (lambda: store.put_routing(bad, torch.randn(2, 2, 3)), lambda: store.get_task(bad),
                 lambda: store.delete_task(bad), lambda: store.has_task(bad)):
        with pytest.raises(ValueError, match="task id"):
            call()
    assert store.list_tasks() == []


def test_delete_and_not_found(store):
    store.put_routing("t1", torch.randn(2, 2, 3))
    assert store.delete_task("t1").id == "t1"
    assert not store.has_task("t1")
    with pytest.raises(TaskNotFound, match="'t1' not found"):
        store.get_task("t1")
    with pytest.raises(TaskNotFound):
        store.delete_task("t1")


def _placeholder(store, task="t", job="job-aaaaaa"):
    return store.put_record(TaskRecord(id=task, method="routing", status="training", version=0,
                                       created_at=time.time(), updated_at=time.time(), job_id=job))


def test_settle_placeholder_removes_fails_or_leaves_alone(store):
    _placeholder(store)
    store.settle_placeholder("t", "job-aaaaaa", error=None)  # cancelled: removed
    assert not store.has_task("t")
    _placeholder(store)
    store.settle_placeholder("t", "job-aaaaaa", error="boom")  # failed: kept, marked
    assert store.get_task("t").status == "failed" and store.get_task("t").error == "boom"
    _placeholder(store, job="job-bbbbbb")
    store.settle_placeholder("t", "job-aaaaaa", error=None)  # another job's now: untouched
    assert store.get_task("t").job_id == "job-bbbbbb" and store.get_task("t").status == "training"
    store.put_routing("t", torch.randn(2, 2, 3), job_id="job-bbbbbb")
    store.settle_placeholder("t", "job-bbbbbb", error="late")  # committed: untouched
    assert store.get_task("t").status == "ready"
    store.settle_placeholder("gone", "job-bbbbbb", error="x")  # absent: nothing happens
    assert not store.has_task("gone")


def test_a_failed_record_keeps_serving_nothing_and_weights_stay_readable_only_when_ready(store):
    rec = store.put_routing("t", torch.randn(2, 2, 3), job_id="job-aaaaaa")
    failed = TaskRecord(**{**rec.to_json(), "status": "failed", "error": "x"})
    store.put_record(failed)
    with pytest.raises(StoreError, match="no weights"):
        store.load_weights(store.get_task("t"))


def test_routing_rows_newest_first_current_inventory_only(store):
    for i, task in enumerate(["old", "mid", "new"]):
        store.put_routing(task, torch.full((2, 2, 3), float(i)))
        time.sleep(0.01)
    store.put_lora("plain", {"x.A": torch.randn(8, 2), "x.B": torch.randn(2, 8)}, method="full")
    _placeholder(store, task="pending")
    rows = store.routing_rows(limit=2)
    assert list(rows) == ["new", "mid"] and torch.equal(rows["new"], torch.full((2, 2, 3), 2.0))
    assert list(store.routing_rows(limit=10, exclude="new")) == ["mid", "old"]
    store.save_inventory(SPEC, NAMES, DIMS, skills(1), backbone_fingerprint="llama-abc")
    assert store.routing_rows(limit=10) == {}  # rows made for another inventory are not candidates


def test_a_description_and_examples_round_trip_and_survive_new_versions(store):
    examples = [{"input": "cat dog", "output": "dog cat"}, {"input": "ünï cödé", "output": "cödé ünï"}]
    now = time.time()
    store.put_record(TaskRecord(id="said", method="routing", status="training", version=0, created_at=now,
                                updated_at=now, description="Reverse the order of the words.", examples=examples))
    placeholder = store.get_task("said")
    assert placeholder.description == "Reverse the order of the words." and placeholder.examples == examples
    ready = store.put_routing("said", torch.randn(2, 2, 3))  # the job's result: a new version says the same
    assert ready.description == placeholder.description and ready.examples == examples
    again = store.put_routing("said", torch.randn(2, 2, 3))
    assert store.get_task("said") == again and again.description == placeholder.description
    assert next(r for r in store.list_tasks() if r.id == "said").examples == examples
    plain = store.put_routing("quiet", torch.randn(2, 2, 3))  # none given: none
    assert plain.description is None and plain.examples == [] and store.get_task("quiet") == plain


def test_demonstrations_are_part_of_a_version_with_or_without_weights(store, tmp_path):
    demos = [{"input": "France", "output": "Paris"}, {"input": "ünï", "output": "cödé"}]
    routed = store.put_routing("both", torch.randn(2, 2, 3), method="auto", demonstrations=demos)
    assert store.get_task("both").demonstrations == demos and routed.kind == "routing"
    alone = store.put_demonstrations("alone", demos, method="demos", metrics={"estimate": {"chosen": "demos"}})
    got = store.get_task("alone")
    assert got == alone and got.kind == "demos" and got.file is None and got.digest is None
    assert got.demonstrations == demos and got.metrics["estimate"] == {"chosen": "demos"} and got.status == "ready"
    assert "alone" not in store.routing_rows(limit=10)  # nothing to retrieve from
    with pytest.raises(StoreError, match="no weights"):
        store.weights_bytes(got)
    retrained = store.put_routing("alone", torch.randn(2, 2, 3), method="routing")  # a new version: its own
    assert retrained.version == 2 and retrained.demonstrations == []
    other = open_store(tmp_path / "copy")  # a copy of the store keeps them (polyserve store copy)
    other.import_task(alone, None)
    assert other.get_task("alone").demonstrations == demos
    with pytest.raises(StoreError, match="demonstration"):
        store.put_demonstrations("none", [], method="demos")
    with pytest.raises(StoreError, match="demonstration"):
        store.put_routing("bad", torch.randn(2, 2, 3), demonstrations=[{"input": "x"}])
    assert not store.has_task("none") and not store.has_task("bad")


QUALITY = {"heldout_exact": 0.875, "sentences_exact": 0.5, "n": 16, "measured": "2026-12-02"}


def test_a_measured_quality_round_trips_and_a_new_version_drops_it(store):
    rec = store.put_routing("measured", torch.randn(2, 2, 3))
    store.import_task(replace(rec, quality=QUALITY), store.weights_bytes(rec))  # as a shipped task comes in
    assert store.get_task("measured").quality == QUALITY
    assert next(r for r in store.list_tasks() if r.id == "measured").quality == QUALITY
    marked = {**QUALITY, "heldout_exact": 0.0, "below_floor": True}
    store.put_record(replace(store.get_task("measured"), quality=marked))
    assert store.get_tasks(["measured"])["measured"].quality == marked
    again = store.put_routing("measured", torch.randn(2, 2, 3))  # other weights: the figures were not theirs
    assert again.quality == {} and store.get_task("measured").quality == {}


@pytest.mark.parametrize("quality", [
    {"sentences_exact": 0.5, "n": 16, "measured": "2026-12-02"},  # no held-out figure
    {**QUALITY, "heldout_exact": 1.5}, {**QUALITY, "sentences_exact": True}, {**QUALITY, "n": 0},
    {**QUALITY, "measured": "yesterday"}, {**QUALITY, "below_floor": "yes"}, {**QUALITY, "extra": 1},
])
def test_a_malformed_quality_is_refused_and_nothing_is_written(store, quality):
    rec = store.put_routing("measured", torch.randn(2, 2, 3))
    with pytest.raises(StoreError, match="quality"):
        store.put_record(replace(rec, quality=quality))
    with pytest.raises(StoreError, match="quality"):
        store.import_task(replace(rec, id="other", quality=quality), store.weights_bytes(rec))
    assert store.get_task("measured") == rec and not store.has_task("other")


def test_import_task_keeps_the_record_and_checks_the_digest(store, tmp_path):
    rec = store.put_routing("a", torch.randn(2, 2, 3))
    blob = store.weights_bytes(rec)
    other = open_store(tmp_path / "other")
    other.import_task(rec, blob)
    assert other.get_task("a") == rec and torch.equal(other.load_routing("a"), store.load_routing("a"))
    with pytest.raises(StoreError, match="digest"):
        other.import_task(TaskRecord(**{**rec.to_json(), "id": "b"}), st_save({"logits": torch.zeros(2, 2, 3)}))
    assert not other.has_task("b")


def test_task_stamps_change_on_every_write_and_delete(store):
    store.put_routing("a", torch.randn(2, 2, 3))
    first = store.task_stamps()
    assert set(first) == {"a"}
    store.put_routing("a", torch.randn(2, 2, 3))
    assert store.task_stamps()["a"] != first["a"]
    store.delete_task("a")
    assert store.task_stamps() == {}


def test_jobs_examples_cancel_and_prune(store):
    store.put_job({"id": "job-abc123", "status": "queued"})
    store.put_job_examples("job-abc123", [{"input": "a", "output": "b"}])
    assert store.get_job("job-abc123")["status"] == "queued"
    assert store.get_job_examples("job-abc123") == [{"input": "a", "output": "b"}]
    assert [j["id"] for j in store.list_jobs()] == ["job-abc123"]
    assert not store.cancel_requested("job-abc123")
    store.request_cancel("job-abc123")
    store.request_cancel("job-abc123")  # twice is fine
    assert store.cancel_requested("job-abc123")
    for bad in ["../etc/passwd", "job-../x", "x", "job-'; --"]:
        with pytest.raises(JobNotFound):
            store.get_job(bad)
    with pytest.raises(JobNotFound):
        store.get_job("job-zzzzzz")
    now = time.time()
    store.put_job({"id": "job-old111", "status": "succeeded", "finished_at": now - 100})
    store.put_job({"id": "job-new222", "status": "failed", "finished_at": now})
    store.put_job({"id": "job-run333", "status": "running"})
    assert store.prune_jobs(older_than=now - 10) == 1
    assert sorted(j["id"] for j in store.list_jobs()) == ["job-abc123", "job-new222", "job-run333"]
    with pytest.raises(JobNotFound):
        store.get_job("job-old111")


HOLDER = r"""
import sys, time
from adapters_store.store import open_store
store = open_store(sys.argv[1])
hold = store.hold_job(sys.argv[2])
print("held" if hold is not None else "busy", flush=True)
time.sleep(60)  # killed here
"""


def test_a_job_claim_is_exclusive_and_dies_with_its_process(store, location):
    """hold_job: one holder at a time across processes; a SIGKILLed holder's claim is free again
    (how recover() tells an interrupted job from one running elsewhere)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, location, "job-abc123"], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert store.hold_job("job-abc123") is None
        other = store.hold_job("job-xyz789")  # another job is free
        assert other is not None
        other.release()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 10
    while (hold := store.hold_job("job-abc123")) is None:
        assert time.time() < deadline, "the dead holder's claim was never released"
        time.sleep(0.05)
    assert store.hold_job("job-abc123") is None  # now ours
    hold.release()
    again = store.hold_job("job-abc123")
    assert again is not None
    again.release()


WRITER = r"""
import sys, torch
from adapters_store.store import open_store
store = open_store(sys.argv[1])
for i in range(int(sys.argv[2])):
    store.put_routing("shared", torch.full((2, 2, 3), float(i)))
"""


def test_concurrent_writers_from_two_processes_lose_no_version(store, location):
    """Each write is one read-modify-write: two processes writing one task 15 times each end at
    version 30 with a readable row (a lost update would leave fewer versions)."""
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, location, "15"]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    record = store.get_task("shared")
    assert record.version == 30
    assert store.load_routing("shared").shape == (2, 2, 3)


def test_directory_store_is_the_default_for_paths(tmp_path):
    assert isinstance(open_store(tmp_path / "s"), DirectoryStore)
    assert isinstance(open_store(str(tmp_path / "s2")), DirectoryStore)


def test_change_cursor_moves_on_writes_and_deletes_or_is_absent(store):
    first = store.change_cursor()
    if isinstance(store, DirectoryStore):
        assert first is None  # a directory has no O(1) cursor: re-scans compare stamps
        return
    store.put_routing("a", torch.randn(2, 2, 3))
    second = store.change_cursor()
    assert second > first
    assert store.change_cursor() == second  # reading it changes nothing
    store.delete_task("a")
    assert store.change_cursor() > second


def test_subscribe_pushes_changes_made_by_other_processes(store, location):
    seen: list[str | None] = []
    stop = store.subscribe(seen.append)
    if isinstance(store, DirectoryStore):
        assert stop is None
        return
    try:
        time.sleep(0.5)  # LISTEN is registered
        other = open_store(location)
        other.put_routing("pushed", torch.randn(2, 2, 3))
        other.delete_task("pushed")
        deadline = time.time() + 5
        while seen.count("pushed") < 2:
            assert time.time() < deadline, seen
            time.sleep(0.02)
        other.close()
    finally:
        stop()


def test_a_shared_secret_is_made_once_and_read_by_every_node(empty, location, tmp_path):
    """The L2 signing key: 32 random bytes, made by the first node that asks, the same for a
    second node (another store object, another node cache) and for every later ask."""
    first = empty.shared_secret("cache-secret")
    other = open_store(location, cache_dir=tmp_path / "other-node")
    try:
        assert len(first) == 32 and other.shared_secret("cache-secret") == first
        assert empty.shared_secret("cache-secret") == first
        assert other.shared_secret("another") not in (first, b"")
    finally:
        close = getattr(other, "close", None)
        if close:
            close()


def test_the_job_queue_leases_one_claimer_at_a_time_and_expired_leases_are_claimed_again(store):
    """The fleet's queue: oldest first, one live lease per job, a heartbeat keeps it, an expired one
    is taken over (attempts + 1) and the old claimer can neither renew nor release it any more."""
    assert store.claim_job("w1", 5) is None
    for job_id in ("job-first1", "job-second"):
        store.enqueue_job(job_id)
        time.sleep(0.01)  # enqueue order is claim order
    store.enqueue_job("job-first1")  # twice changes nothing
    assert store.job_enqueued("job-first1") and not store.job_enqueued("job-absent")
    with pytest.raises(ValueError, match="lease_seconds"):
        store.claim_job("w1", 0)
    a = store.claim_job("w1", 0.5)
    b = store.claim_job("w2", 30)
    assert (a.job_id, a.attempts, b.job_id) == ("job-first1", 1, "job-second")
    assert store.claim_job("w3", 30) is None  # both leased
    assert a.renew() and a.still_held()
    time.sleep(0.7)  # a stops heart-beating: its lease runs out
    c = store.claim_job("w3", 30)
    assert (c.job_id, c.attempts, c.owner) == ("job-first1", 2, "w3")
    assert not a.renew() and not a.still_held() and c.still_held()
    a.release()  # a stale claimer cannot drop the job from the queue
    assert store.job_enqueued("job-first1")
    c.give_back()  # a worker stopping mid-job: claimable again at once
    d = store.claim_job("w4", 30)
    assert (d.job_id, d.attempts) == ("job-first1", 3)
    d.release()
    b.release()
    assert not store.job_enqueued("job-first1") and not store.job_enqueued("job-second")
    assert store.claim_job("w1", 30) is None


def test_one_named_job_is_claimed_only_while_its_lease_is_free(store):
    """claim_job(job_id=...): that job, not the oldest; never one a live lease holds; an expired
    lease is taken over; a job that is not queued is never claimed."""
    for job_id in ("job-older1", "job-named1"):
        store.enqueue_job(job_id)
        time.sleep(0.01)
    assert store.claim_job("r", 30, job_id="job-absent") is None
    mine = store.claim_job("r", 0.3, job_id="job-named1")
    assert (mine.job_id, mine.attempts, mine.owner) == ("job-named1", 1, "r")
    assert store.claim_job("r2", 30, job_id="job-named1") is None  # held
    w = store.claim_job("w", 30)
    assert w.job_id == "job-older1" and store.claim_job("w2", 30) is None  # the named one stays held
    assert store.claim_job("r2", 30, job_id="job-older1") is None  # a worker holds it
    time.sleep(0.4)
    taken = store.claim_job("r2", 30, job_id="job-named1")
    assert (taken.job_id, taken.attempts) == ("job-named1", 2) and not mine.still_held()
    assert store.queued_jobs() == 2
    taken.release()
    assert store.queued_jobs() == 1
    w.release()
    assert store.queued_jobs() == 0
    assert not store.job_enqueued("job-named1") and store.claim_job("r", 30, job_id="job-named1") is None
    with pytest.raises(JobNotFound):
        store.claim_job("r", 30, job_id="../etc/passwd")


def test_a_leased_run_writes_its_job_only_while_it_holds_the_lease(store):
    store.put_job({"id": "job-lease1", "status": "queued"})
    store.enqueue_job("job-lease1")
    first = store.claim_job("w1", 0.2)
    assert store.put_job_if_held({"id": "job-lease1", "status": "running", "by": "w1"}, first.token)
    assert store.get_job("job-lease1")["by"] == "w1"
    time.sleep(0.3)
    second = store.claim_job("w2", 30)
    assert store.put_job_if_held({"id": "job-lease1", "status": "running", "by": "w2"}, second.token)
    assert not store.put_job_if_held({"id": "job-lease1", "status": "succeeded", "by": "w1"}, first.token)
    assert store.get_job("job-lease1") == {"id": "job-lease1", "status": "running", "by": "w2"}
    second.release()  # finished: no lease holds it any more, so no run writes through one
    assert not store.put_job_if_held({"id": "job-lease1", "status": "failed"}, second.token)
    assert store.get_job("job-lease1")["by"] == "w2"
    with pytest.raises(JobNotFound):
        store.put_job_if_held({"id": "../x", "status": "queued"}, "t")


def test_pruning_a_finished_job_drops_its_queue_entry(store):
    store.put_job({"id": "job-old111", "status": "succeeded", "finished_at": time.time() - 100})
    store.enqueue_job("job-old111")
    assert store.prune_jobs(older_than=time.time() - 10) == 1
    assert not store.job_enqueued("job-old111")


CLAIMER = r"""
import sys, time
from adapters_store.store import open_store
store = open_store(sys.argv[1])
print("ready", flush=True)
sys.stdin.readline()  # every claimer starts at once
got = []
while (lease := store.claim_job(sys.argv[2], 60)) is not None:
    got.append(lease.job_id)
print(" ".join(got), flush=True)
"""


def test_claimers_in_four_processes_at_once_take_each_job_exactly_once(store, location):
    """Claims race: every job goes to exactly one claimer (a claim that is not atomic, e.g. a
    SELECT then an UPDATE without a row lock, hands one job to two)."""
    jobs = [f"job-race{i:03d}" for i in range(40)]
    for job_id in jobs:
        store.enqueue_job(job_id)
    procs = [subprocess.Popen([sys.executable, "-c", CLAIMER, location, f"w{i}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    got = [p.communicate(timeout=120)[0].split() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    claimed = [job_id for part in got for job_id in part]
    assert sorted(claimed) == jobs


def test_queued_jobs_of_one_tenant_count_its_queue_entries_leased_or_not(store):
    """A tenant's registration quota in fleet mode (POLYSERVE_JOBS=off) counts its jobs in the
    queue, from the job records' tenant."""
    for job_id, tenant in (("job-alice01", "alice"), ("job-alice02", "alice"), ("job-bob0001", "bob"),
                           ("job-nobody1", None)):
        store.put_job({"id": job_id, "task": "t", "status": "queued", "tenant": tenant})
        store.enqueue_job(job_id)
    store.put_job({"id": "job-alice03", "task": "t", "status": "succeeded", "tenant": "alice"})  # not queued
    assert (store.queued_jobs(), store.queued_jobs("alice"), store.queued_jobs("bob"), store.queued_jobs("eve")) \
        == (4, 2, 1, 0)
    lease = store.claim_job("w", 30)  # leased jobs still count: their worker runs them
    assert lease is not None and store.queued_jobs("alice") == 2
    lease.release()
    assert store.queued_jobs("alice") + store.queued_jobs("bob") == 2
