"""The job runner's state machine and persistence, with a scripted adaptation (no model)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from adapters_store.lora.spec import InventorySpec
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreUnavailable
from server.jobs.model import IllegalTransition, Job
from server.jobs.runner import JobRunner


@dataclass
class FakeResult:
    kind: str = "routing"
    tensors: dict = field(default_factory=lambda: {"logits": torch.ones(1, 1, 2)})
    metrics: dict = field(default_factory=lambda: {"exact_match": 0.75})


class FakeAdaptation:
    def __init__(self, steps: int, progress, fail_at: int | None = None) -> None:
        self.steps, self.progress, self.fail_at, self.done, self.cancelled = steps, progress, fail_at, 0, False

    def step(self) -> bool:
        if self.fail_at is not None and self.done == self.fail_at:
            raise RuntimeError("loss became NaN")
        self.done += 1
        self.progress({"step": self.done, "steps": self.steps, "loss": 1.0 / self.done})
        return self.done < self.steps

    def cancel(self) -> None:
        self.cancelled = True

    def result(self) -> FakeResult:
        return FakeResult()


@pytest.fixture
def store(tmp_path) -> DirectoryStore:
    s = DirectoryStore(tmp_path / "store")
    s.save_inventory(InventorySpec(n_skills=2, n_heads=1, rank=1, target_modules=("q",)), ["m.q"], [(2, 2)],
                     {"m.q.A": torch.zeros(1, 2, 2, 1), "m.q.B": torch.zeros(1, 2, 1, 2)}, backbone_fingerprint="fp")
    return s


def make_runner(store, fail_at=None, steps=3, changed=None, finished=None, cancel_poll_seconds=0.2):
    made = []

    def factory(job, examples, progress):
        assert examples == [{"input": "a", "output": "b"}]
        made.append(FakeAdaptation(steps, progress, fail_at))
        return made[-1]

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0, cancel_poll_seconds=cancel_poll_seconds,
                       on_task_changed=(changed.append if changed is not None else lambda t: None),
                       on_job_finished=(finished.append if finished is not None else lambda j: None))
    return runner, made


EXAMPLES = [{"input": "a", "output": "b"}]


def run_to_end(runner: JobRunner, limit: int = 100) -> int:
    """Slices until the runner has nothing left; the job writes the engine thread hands off are
    waited for before each slice (a disk that keeps up), so the count is the job's own slices."""
    n = 0
    while True:
        runner.flush()
        if not runner.step():
            break
        n += 1
        assert n < limit
    return n


def test_job_succeeds_and_commits_the_routing(store, caplog):
    changed, finished = [], []
    runner, _ = make_runner(store, changed=changed, finished=finished)
    job = runner.submit("new-task", EXAMPLES, method="routing", steps=3, seed=0)
    assert job.status == "queued"
    assert store.get_task("new-task").status == "training"
    assert store.get_task("new-task").job_id == job.id
    assert run_to_end(runner) == 3
    done = runner.get(job.id)
    assert done.status == "succeeded" and done.progress == 1.0 and done.metrics["exact_match"] == 0.75
    assert done.started_at and done.finished_at and done.finished_at >= done.started_at
    record = store.get_task("new-task")
    assert record.status == "ready" and record.job_id == job.id
    assert torch.equal(store.load_routing("new-task"), torch.ones(1, 1, 2))
    assert Job.from_json(store.get_job(job.id)).status == "succeeded"  # persisted
    assert changed == ["new-task", "new-task"]  # its placeholder, then its first version
    assert [j.status for j in finished] == ["succeeded"]
    assert not store.job_lock_path(job.id).exists()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a job that went well logs no error


def test_failure_is_recorded_with_a_clear_error(store):
    runner, _ = make_runner(store, fail_at=1)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0)
    run_to_end(runner)
    failed = runner.get(job.id)
    assert failed.status == "failed" and failed.error == {"type": "adaptation_error", "message": "loss became NaN"}
    assert store.get_task("t").status == "failed" and store.get_task("t").error == failed.error["message"]


def test_cancel_running_and_queued(store):
    runner, made = make_runner(store, steps=50)
    first = runner.submit("t1", EXAMPLES, method="routing", steps=50, seed=0)
    second = runner.submit("t2", EXAMPLES, method="routing", steps=50, seed=0)
    runner.step()
    runner.step()
    assert runner.get(first.id).status == "running"
    assert runner.cancel(second.id).status == "cancelled"  # queued: at once
    assert not store.has_task("t2")
    runner.cancel(first.id)
    runner.step()
    runner.flush()  # the end of the job is written by the I/O thread
    assert runner.get(first.id).status == "cancelled" and made[0].cancelled
    assert not store.has_task("t1")
    assert runner.step() is False


def test_illegal_transitions_raise():
    job = Job(id="job-abcdef", task="t", method="routing")
    job.transition("running")
    job.transition("succeeded")
    with pytest.raises(IllegalTransition):
        job.transition("running")
    assert job.transition("succeeded") is False


def test_recover_marks_orphaned_jobs_interrupted(store):
    runner, _ = make_runner(store, steps=10)
    job = runner.submit("t", EXAMPLES, method="routing", steps=10, seed=0)
    runner.step()
    runner.step()  # running
    runner.flush()  # persisted
    # "crash": the process dies; its flock vanishes with it. Simulate by dropping the runner's lock.
    runner.leases.release(job.id)
    fresh, _ = make_runner(store)
    assert fresh.recover() == [job.id]
    after = fresh.get(job.id)
    assert after.status == "failed" and after.error["type"] == "interrupted"
    assert store.get_task("t").status == "failed"
    assert fresh.recover() == []


def test_recover_leaves_jobs_of_a_live_replica_alone(store):
    job = Job(id="job-live01", task="t", method="routing", status="running")
    store.put_job(job.to_json())
    lock = store.job_lock_path(job.id)
    holder = subprocess.Popen([sys.executable, "-c",
        (f"import fcntl,time;f=open({str(lock)!r},'a+');fcntl.flock(f,fcntl.LOCK_EX);"
         "print('locked',flush=True);time.sleep(30)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        runner, _ = make_runner(store)
        assert runner.recover() == []
        assert Job.from_json(store.get_job(job.id)).status == "running"
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.05)
    runner, _ = make_runner(store)
    assert runner.recover() == [job.id]


def test_recover_never_overwrites_a_job_that_finished_after_the_listing(store, monkeypatch):
    """recover() lists jobs, then takes each one's lock: a job that succeeded in between (its owner
    released the lock) must stay succeeded."""
    runner, _ = make_runner(store, steps=2)
    job = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    runner.step()
    runner.flush()
    stale = [store.get_job(job.id)]  # the listing: still running
    assert stale[0]["status"] == "running"
    run_to_end(runner)
    assert runner.get(job.id).status == "succeeded"
    monkeypatch.setattr(store, "list_jobs", lambda: stale)
    fresh, _ = make_runner(store)
    assert fresh.recover() == []
    assert Job.from_json(store.get_job(job.id)).status == "succeeded"
    assert store.get_task("t").status == "ready"


def test_a_task_deleted_before_the_commit_stays_deleted(store):
    """Another replica deletes the task while this one trains it: the commit sees it gone, the
    result is discarded and the job is cancelled (no resurrected task)."""
    runner, made = make_runner(store, steps=2)
    job = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    runner.step()
    made[0].result = lambda: (store.delete_task("t"), FakeResult())[1]  # the delete lands just before the commit
    run_to_end(runner)
    after = runner.get(job.id)
    assert after.status == "cancelled"
    assert not store.has_task("t")
    assert not [p for p in (store.root / "tasks").rglob("*.safetensors")]


def test_a_cancel_marker_from_another_replica_stops_queued_and_running_jobs(store):
    runner, made = make_runner(store, steps=50)
    running = runner.submit("t1", EXAMPLES, method="routing", steps=50, seed=0)
    queued = runner.submit("t2", EXAMPLES, method="routing", steps=50, seed=0)
    runner.step()
    other = DirectoryStore(store.root)  # another process's view of the same store
    other.request_cancel(running.id)
    other.request_cancel(queued.id)
    assert runner.check_cancels() == 2  # what the poll thread does between steps
    run_to_end(runner)
    assert runner.get(running.id).status == "cancelled" and made[0].cancelled and made[0].done == 1
    assert runner.get(queued.id).status == "cancelled" and len(made) == 1  # never started
    assert not store.has_task("t1") and not store.has_task("t2")


def test_step_never_reads_cancel_markers_and_the_poll_thread_finds_them(store, monkeypatch):
    """The engine thread's step() reads no cancel marker (a store read that a slow disk or a
    database outage would turn into a decoding stall); the runner's poll thread reads them and
    the next step stops the job."""
    runner, made = make_runner(store, steps=10_000, cancel_poll_seconds=0.05)
    job = runner.submit("t1", EXAMPLES, method="routing", steps=10_000, seed=0)
    readers: set[str] = set()
    real = store.cancel_requested
    monkeypatch.setattr(store, "cancel_requested",
                        lambda job_id: (readers.add(threading.current_thread().name), real(job_id))[1])
    runner.step()
    DirectoryStore(store.root).request_cancel(job.id)
    deadline = time.time() + 10
    while runner.get(job.id).status != "cancelled":
        assert time.time() < deadline, "the poll thread never saw the marker"
        runner.step()
        time.sleep(0.01)
    runner.flush()
    assert threading.current_thread().name not in readers
    assert readers == {"polyserve-job-cancels"}
    assert made[0].cancelled and not store.has_task("t1")


KILL_CHILD = r"""
import os, sys, time, torch
from pathlib import Path
from adapters_store.store.directory import DirectoryStore
from server.jobs.runner import JobRunner

root, point = sys.argv[1], sys.argv[2]
signal_file = Path(root) / "at-the-point"

class Quick:
    def __init__(self, progress): self.progress = progress
    def step(self): return False
    def cancel(self): pass
    def result(self):
        class R: kind, tensors, metrics = "routing", {"logits": torch.ones(1, 1, 2)}, {}
        return R()

def pause():
    signal_file.write_text("")
    time.sleep(60)  # the parent SIGKILLs us here

store = DirectoryStore(root)
if point == "weights-written":  # inside the commit: weights file written, record not yet
    from adapters_store.store.atomic import atomic_write_bytes
    real = store._commit_task
    def commit(record, blob, previous):
        if record.status != "ready":
            return real(record, blob, previous)
        atomic_write_bytes(store._task_dir(record.id) / record.file, blob)
        pause()
    store._commit_task = commit
else:  # "record-written": the commit point passed, the job not yet marked succeeded
    real_put_job = store.put_job
    store.put_job = lambda job: pause() if job["status"] == "succeeded" else real_put_job(job)
runner = JobRunner(store, lambda job, ex, progress: Quick(progress), replica_id="child", persist_every=0.0)
job = runner.submit("t", [{"input": "a", "output": "b"}], method="routing", steps=1, seed=0)
print(job.id, flush=True)
while runner.step():
    pass
"""


@pytest.mark.parametrize("point", ["weights-written", "record-written"])
def test_sigkill_during_the_commit_then_recover(store, point):
    """A real process is SIGKILLed inside the commit; the next start finds a consistent store: before
    the commit point the job failed (interrupted) and the task is not served; after it the job
    succeeded (recovered) and the task is ready with the committed row."""
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(store.root), point], stdout=subprocess.PIPE,
                            text=True)
    job_id = proc.stdout.readline().strip()
    deadline = time.time() + 30
    while not (store.root / "at-the-point").exists():
        assert proc.poll() is None and time.time() < deadline, "the child never reached the kill point"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    reopened = DirectoryStore(store.root)
    runner, _ = make_runner(reopened)
    assert runner.recover() == [job_id]
    job = runner.get(job_id)
    record = reopened.get_task("t")
    if point == "weights-written":
        assert job.status == "failed" and job.error["type"] == "interrupted"
        assert record.status == "failed"
    else:
        assert job.status == "succeeded"
        assert record.status == "ready" and record.job_id == job_id
        assert torch.equal(reopened.load_routing("t"), torch.ones(1, 1, 2))
    assert runner.recover() == []  # settled


def test_no_file_or_redis_io_under_the_runner_lock(store):
    """While a finishing job's file write (fsync) and its notification (Redis publish) are stuck,
    reading any job and cancelling another still answer: the runner lock guards memory only."""
    import threading

    entered, release = threading.Event(), threading.Event()
    real_put_job = store.put_job

    def stuck_put_job(data):
        if data["status"] == "succeeded":
            entered.set()
            release.wait(30)
        real_put_job(data)

    store.put_job = stuck_put_job
    published = []
    runner, _ = make_runner(store, steps=1, changed=published)
    job = runner.submit("t", EXAMPLES, method="routing", steps=1, seed=0)
    other = runner.submit("u", EXAMPLES, method="routing", steps=1, seed=0)
    worker = threading.Thread(target=runner.step)
    worker.start()
    try:
        assert entered.wait(10)
        answers = []
        reader = threading.Thread(
            target=lambda: answers.append((runner.get(job.id).status, runner.cancel(other.id).status)))
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "reading a job waited on another job's file write"
        assert answers == [("succeeded", "cancelled")]
    finally:
        release.set()
        worker.join(10)
    runner.flush()
    assert Job.from_json(store.get_job(job.id)).status == "succeeded"


def test_finished_jobs_leave_memory_after_the_retention(store):
    runner, _ = make_runner(store, steps=1)
    job = runner.submit("t", EXAMPLES, method="routing", steps=1, seed=0)
    run_to_end(runner)
    queued = runner.submit("u", EXAMPLES, method="routing", steps=1, seed=0)  # unfinished: never forgotten
    finished_at = runner.get(job.id).finished_at
    assert runner.forget_finished(older_than=time.time() - 60) == 0 and runner.owns(job.id)
    assert runner.forget_finished(older_than=finished_at) == 0 and runner.owns(job.id)  # ended at the cutoff: kept
    assert runner.forget_finished(older_than=time.time() + 1) == 1 and not runner.owns(job.id)
    assert runner.owns(queued.id) and job.id not in runner.journal._io  # its write lock leaves memory with it
    assert runner.get(job.id).status == "succeeded"  # still readable from the store until pruned there


def test_serve_early_version_survives_a_crash_but_is_not_the_jobs_result(store):
    """After a crash mid-training, the early (retrieved) version stays served and the job is
    failed 'interrupted', not 'succeeded': the early version is not the commit point."""
    runner, _ = make_runner(store, steps=10)
    job = runner.submit("t", EXAMPLES, method="routing", steps=10, seed=0, serve_early=True)
    runner.step()
    early = FakeResult(tensors={"logits": torch.full((1, 1, 2), 2.0)}, metrics={"method": "retrieve"})
    runner.commit_early(runner.state.jobs[job.id], early)
    runner.flush()
    record = store.get_task("t")
    assert record.status == "ready" and record.version == 1 and record.source["stage"] == "early"
    assert runner.get(job.id).live_version == 1
    runner.step()
    runner.flush()  # a dead process writes nothing later: let this one's hand-offs land first
    runner.leases.release(job.id)  # the "crash"
    fresh, _ = make_runner(store)
    assert fresh.recover() == [job.id]
    assert fresh.get(job.id).status == "failed" and fresh.get(job.id).error["type"] == "interrupted"
    assert store.get_task("t").status == "ready" and torch.equal(store.load_routing("t"), torch.full((1, 1, 2), 2.0))


def test_serve_early_then_the_trained_result_is_the_next_version(store):
    runner, _ = make_runner(store, steps=3)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0, serve_early=True)
    runner.step()
    runner.commit_early(runner.state.jobs[job.id], FakeResult(tensors={"logits": torch.full((1, 1, 2), 2.0)}))
    run_to_end(runner)
    done = runner.get(job.id)
    assert done.status == "succeeded" and done.live_version == 2
    record = store.get_task("t")
    assert record.version == 2 and "stage" not in record.source
    assert torch.equal(store.load_routing("t"), torch.ones(1, 1, 2))


def test_building_a_job_runs_off_the_engine_thread(store):
    """Reading examples and tokenising (1,000 examples: ~0.26 s with the default tokenizer) must
    not stall the engine: step() returns while the build blocks, and the build ran elsewhere."""
    import threading

    release, seen = threading.Event(), []

    def factory(job, examples, progress):
        seen.append(threading.current_thread())
        assert release.wait(30), "the build was never released"
        return FakeAdaptation(2, progress)

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    for _ in range(3):
        assert runner.step() is True  # returns while the build is still blocked
    assert runner.get(job.id).status == "queued" and runner.pending == 1
    assert seen and seen[0] is not threading.current_thread()
    release.set()
    run_to_end(runner, limit=1000)
    assert runner.get(job.id).status == "succeeded" and len(seen) == 1  # built once, however many slices waited


def test_a_job_cancelled_while_it_is_built_never_runs(store):
    import threading

    release, made = threading.Event(), []

    def factory(job, examples, progress):
        release.wait(30)
        made.append(FakeAdaptation(5, progress))
        return made[-1]

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=5, seed=0)
    assert runner.step() is True
    runner.cancel(job.id)
    release.set()
    run_to_end(runner, limit=1000)
    assert runner.get(job.id).status == "cancelled" and made[0].done == 0
    assert not store.has_task("t")


@pytest.mark.parametrize("status", ["cancelled", "failed"])
def test_a_delete_racing_a_finished_jobs_cleanup_neither_raises_nor_resurrects(store, status):
    """Replica b deletes a task while replica a's runner cleans up the job that trained it (a
    cancel marker or a failure): whoever comes second must find the task gone without an error,
    and the task stays deleted. Real threads and two DirectoryStore views, many rounds: before the fix the
    cleanup's check and its change were two lock sections, and the loser raised TaskNotFound
    (the job then stayed "running" forever) or re-created the task as "failed"."""
    import threading

    from adapters_store.store.errors import TaskNotFound
    from adapters_store.store.records import TaskRecord
    from server.jobs.journal import mark_task_not_ready

    replica_b = DirectoryStore(store.root)
    job = Job(id="job-0123456789abcdef", task="t", method="routing", steps=1, seed=0, n_examples=1, owner="a")
    error = None if status == "cancelled" else {"type": "adaptation_error", "message": "loss became NaN"}
    for _ in range(150):
        store.put_record(TaskRecord(id="t", method="routing", status="training", version=0,
                                    created_at=0.0, updated_at=0.0, job_id=job.id))
        barrier, raised = threading.Barrier(2), []

        def cleanup(barrier=barrier, raised=raised):
            barrier.wait()
            try:
                mark_task_not_ready(store, job, status, error)
            except Exception as err:  # noqa: BLE001 - recorded for the assertion
                raised.append(err)

        def delete(barrier=barrier):  # what a DELETE does once the record exists (a missing task is its 404)
            barrier.wait()
            try:
                replica_b.delete_task("t")
            except TaskNotFound:
                pass

        threads = [threading.Thread(target=cleanup), threading.Thread(target=delete)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert not raised, raised
        assert not store.has_task("t"), f"the {status} job's cleanup re-created the deleted task"


def test_the_cleanup_leaves_a_task_that_is_not_its_placeholder(store):
    """Only the job's own unfinished placeholder is touched: another job's task and a ready
    (serve_early) version stay as they are."""
    from adapters_store.store.records import TaskRecord
    from server.jobs.journal import mark_task_not_ready

    job = Job(id="job-0123456789abcdef", task="t", method="routing", steps=1, seed=0, n_examples=1, owner="a")
    other = store.put_routing("t", torch.ones(1, 1, 2), job_id="job-ffffffffffffffff")
    mark_task_not_ready(store, job, "cancelled", None)
    assert store.get_task("t") == other
    early = store.put_routing("t", torch.ones(1, 1, 2), job_id=job.id, source={"stage": "early"})
    mark_task_not_ready(store, job, "failed", {"message": "x"})
    assert store.get_task("t") == early
    store.delete_task("t")
    store.put_record(TaskRecord(id="t", method="routing", status="training", version=0,
                                created_at=0.0, updated_at=0.0, job_id=job.id))
    mark_task_not_ready(store, job, "failed", {"message": "loss became NaN"})
    failed = store.get_task("t")
    assert failed.status == "failed" and failed.error == "loss became NaN"


def test_a_commit_that_finds_the_result_committed_marks_the_job_succeeded_and_writes_nothing(store):
    """An earlier run of the job committed while this one trained (the task names the job, ready):
    the commit writes no version 2, says so in an event, and the job ends succeeded."""
    runner, _ = make_runner(store, steps=3)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0)
    runner.step()
    runner.step()
    store.put_routing("t", torch.full((1, 1, 2), 2.0), job_id=job.id)  # the earlier run's commit
    run_to_end(runner)
    runner.flush()
    done = Job.from_json(store.get_job(job.id))
    assert done.status == "succeeded" and runner.get(job.id).status == "succeeded"
    assert ("status", "the result was committed by an earlier run of this job") in [
        (e["type"], e["message"]) for e in done.events]
    assert store.get_task("t").version == 1 and torch.equal(store.load_routing("t"), torch.full((1, 1, 2), 2.0))
    assert runner.pending == 0 and not runner.step()


def test_a_commit_whose_lease_was_lost_drops_the_run(store):
    """No progress write in between (persist_every never due), so the commit itself is what finds
    the lease gone: the run is dropped, the other run's result stays the only version."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("lease", EXAMPLES, method="routing", steps=2, seed=0)

    def runner_for(name: str, made: list, persist_every: float) -> JobRunner:
        def factory(job, examples, progress):
            made.append(FakeAdaptation(2, progress))
            return made[-1]

        return JobRunner(store, factory, replica_id=name, persist_every=persist_every)

    made1: list = []
    w1 = runner_for("w1", made1, 1e12)
    w1.adopt(store.claim_job("w1", 0.2))
    w1.flush()
    assert w1.step()  # built, running, one step
    w1.flush()
    time.sleep(0.3)
    w2 = runner_for("w2", [], 0.0)
    w2.adopt(store.claim_job("w2", 30))
    run_to_end(w2)
    w2.flush()
    run_to_end(w1)
    w1.flush()
    assert made1[0].done == 2 and not w1.owns(job.id) and w1.pending == 0
    assert store.get_task("lease").version == 1 and Job.from_json(store.get_job(job.id)).owner == "w2"


def test_the_early_version_carries_the_jobs_source_method_and_metrics(store):
    changed: list = []
    runner, _ = make_runner(store, steps=3, changed=changed)
    job = runner.submit("t", EXAMPLES, method="retrieve", steps=3, seed=0, serve_early=True)
    runner.step()
    changed.clear()
    runner.commit_early(runner.state.jobs[job.id], FakeResult(tensors={"logits": torch.full((1, 1, 2), 2.0)},
                                                         metrics={"exact_match": 0.5}))
    runner.flush()
    record = store.get_task("t")
    assert record.source == {"job_id": job.id, "n_examples": 1, "method": "retrieve", "stage": "early"}
    assert record.method == "retrieve" and record.metrics == {"exact_match": 0.5} and record.job_id == job.id
    persisted = Job.from_json(store.get_job(job.id))
    assert persisted.live_version == 1
    assert [(e["type"], e["message"], e["data"]) for e in persisted.events if "retrieved" in e["message"]] == [
        ("status", "serving the retrieved routing as version 1 while training goes on", {"version": 1})]
    assert changed == ["t"]


def test_auto_serves_its_demonstrations_early_then_the_chosen_form(store):
    runner, _ = make_runner(store, steps=3)
    job = runner.submit("t", EXAMPLES, method="auto", steps=3, seed=0, serve_early=True)
    runner.step()
    demos = [{"input": "a", "output": "b"}]
    early = FakeResult(kind="demos", tensors={}, metrics={"method": "demos", "cv_exact": 0.5})
    early.demonstrations = demos
    runner.commit_early(runner.state.jobs[job.id], early)
    runner.flush()
    record = store.get_task("t")
    assert record.status == "ready" and record.version == 1 and record.source["stage"] == "early"
    assert record.kind == "demos" and record.demonstrations == demos and record.metrics["cv_exact"] == 0.5
    events = [e["message"] for e in runner.get(job.id).events]
    assert "serving the demonstrations as version 1 while training goes on" in events
    run_to_end(runner)
    done = runner.get(job.id)
    assert done.status == "succeeded" and done.live_version == 2
    assert store.get_task("t").version == 2 and "stage" not in store.get_task("t").source


def test_recover_goes_through_every_job_and_says_why_each_was_interrupted(store, monkeypatch):
    """Jobs listed in id order: one unreadable, one finished, one enqueued for the workers, one a
    live replica holds, one that finished after the listing, then the orphans: each of the first
    five is skipped, not the end of the listing."""
    from adapters_store.store.records import TaskRecord

    def job(n: int, task: str, status: str, **kw) -> str:
        job_id = f"job-{n:016d}"
        store.put_job(Job(id=job_id, task=task, method="routing", steps=3, seed=0, n_examples=1,
                          status=status, **kw).to_json())
        if status not in ("succeeded", "failed", "cancelled"):
            store.put_record(TaskRecord(id=task, method="routing", status="training", version=0, created_at=0.0,
                                        updated_at=0.0, job_id=job_id))
        return job_id

    store.put_job({"id": "job-0000000000000000"})  # unreadable: no task
    job(1, "done", "succeeded")
    store.enqueue_job(job(2, "fleet", "queued"))
    live = DirectoryStore(store.root).hold_job(job(3, "live", "running"))
    late = job(4, "late", "running")
    queued, running, committed = job(5, "q", "queued"), job(6, "r", "running"), job(7, "c", "running")
    store.put_routing("c", torch.ones(1, 1, 2), job_id=committed)
    real_get = store.get_job
    monkeypatch.setattr(store, "get_job", lambda job_id: real_get(job_id) | (
        {"status": "succeeded"} if job_id == late else {}))
    changed: list = []
    runner, _ = make_runner(store, changed=changed)
    assert runner.recover() == [queued, running, committed]
    assert changed == ["q", "r", "c"]
    for job_id, task, reason in ((queued, "q", "before the job ran"), (running, "r", "while the job was running")):
        message = f"interrupted: the server stopped {reason}"
        assert runner.get(job_id).error == {"type": "interrupted", "message": message}
        assert store.get_task(task).status == "failed" and store.get_task(task).error == message
    done = runner.get(committed)
    recovered = ("status", "recovered: the result was committed before the server stopped")
    assert done.status == "succeeded" and recovered in [(e["type"], e["message"]) for e in done.events]
    assert real_get(late)["status"] == "running" and store.get_task("live").status == "training"
    live.release()


def test_cancel_is_an_event_and_leaves_finished_and_foreign_jobs_alone(store):
    runner, _ = make_runner(store, steps=3)
    running = runner.submit("t1", EXAMPLES, method="routing", steps=3, seed=0)
    runner.step()
    runner.cancel(running.id)
    assert ("status", "cancellation requested") in [(e["type"], e["message"]) for e in runner.get(running.id).events]
    run_to_end(runner)
    done = runner.submit("t2", EXAMPLES, method="routing", steps=3, seed=0)
    run_to_end(runner)
    events = runner.get(done.id).events
    assert runner.cancel(done.id).status == "succeeded" and runner.get(done.id).events == events
    other = Job(id="job-00000000000000bb", task="o", method="routing", steps=3, seed=0, status="running")
    store.put_job(other.to_json())
    assert runner.cancel(other.id).status == "running"  # another replica's: cancelled through the store


def test_check_cancels_counts_each_marker_once_and_skips_finished_jobs(store):
    runner = JobRunner(store, lambda job, examples, progress: FakeAdaptation(3, progress), replica_id="r1",
                       persist_every=0.0, cancel_poll_seconds=3600)
    first = runner.submit("t1", EXAMPLES, method="routing", steps=3, seed=0)
    run_to_end(runner)
    second = runner.submit("t2", EXAMPLES, method="routing", steps=3, seed=0)
    store.request_cancel(first.id)
    store.request_cancel(second.id)
    assert runner.check_cancels() == 1
    assert runner.check_cancels() == 0


def test_a_cancel_marker_the_poll_has_not_read_still_stops_the_commit(store):
    """The marker lands after the last poll: the commit, under the task's lock, sees it and
    discards the result (the job cancelled, its placeholder removed)."""
    runner = JobRunner(store, lambda job, examples, progress: FakeAdaptation(2, progress), replica_id="r1",
                       persist_every=0.0, cancel_poll_seconds=3600)
    job = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    runner.step()
    store.request_cancel(job.id)
    run_to_end(runner)
    assert runner.get(job.id).status == "cancelled" and not store.has_task("t")


def test_a_task_replaced_or_deleted_without_a_marker_before_the_commit_is_left_as_it_is(store):
    from adapters_store.store.records import TaskRecord

    runner, _ = make_runner(store, steps=2)
    replaced = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    runner.step()
    store.put_record(TaskRecord(id="t", method="routing", status="training", version=0, created_at=0.0,
                                updated_at=0.0, job_id="job-00000000000000cc"))
    run_to_end(runner)
    assert runner.get(replaced.id).status == "cancelled" and store.get_task("t").job_id == "job-00000000000000cc"
    deleted = runner.submit("u", EXAMPLES, method="routing", steps=2, seed=0)
    runner.step()
    store.delete_task("u")
    run_to_end(runner)
    after = runner.get(deleted.id)
    assert after.status == "cancelled" and not store.has_task("u")
    assert ("status", "the task was deleted while the job ran; result discarded") in [
        (e["type"], e["message"]) for e in after.events]


class ScriptedProgress:
    """An adaptation that reports what it is given, one report a step."""

    def __init__(self, progress, reports: list[dict]) -> None:
        self.progress, self.reports, self.seen = progress, list(reports), []

    def step(self) -> bool:
        self.progress(self.reports.pop(0))
        return bool(self.reports)

    def cancel(self) -> None:
        pass

    def result(self) -> FakeResult:
        return FakeResult(metrics={"exact_match": 0.5, "flag": True, "names": ["a"], "note": "ok"})


def test_progress_fraction_metrics_and_eval_events(store):
    """The fraction is step / steps (the report's steps, else the job's), capped below 1 until the
    commit; only numbers (no bools) become metrics; an eval report is a metrics event."""
    seen: list = []

    def factory(job, examples, progress):
        adaptation = ScriptedProgress(progress, [
            {"loss": 3.0},
            {"step": 1, "steps": 4, "loss": 2.0, "phase": "train", "flag": True},
            {"step": 3, "loss": 1.5},
            {"step": 8, "steps": 8, "phase": "eval", "eval_loss": 0.25},
            {"step": 9, "steps": 8},
        ])
        real = adaptation.progress

        def spy(info):
            real(info)
            seen.append((runner.get(job.id).progress, dict(runner.get(job.id).metrics)))

        adaptation.progress = spy
        return adaptation

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=6, seed=0)
    run_to_end(runner)
    assert [p for p, _ in seen] == [0.0, 0.25, 0.5, 0.999, 0.999]
    assert seen[0][1] == {"loss": 3.0} and seen[1][1] == {"step": 1, "steps": 4, "loss": 2.0}
    done = runner.get(job.id)
    metrics_events = [(e["type"], e["message"], e["level"], e["data"]) for e in done.events if e["type"] != "status"]
    assert metrics_events == [("metrics", "step 8: eval loss 0.25", "info", {"step": 8, "steps": 8, "eval_loss": 0.25})]
    assert done.status == "succeeded" and done.metrics["exact_match"] == 0.5 and done.metrics["note"] == "ok"
    assert "flag" not in done.metrics and "names" not in done.metrics


def test_progress_is_written_at_most_every_persist_every(store):
    runner, _ = make_runner(store, steps=4)
    runner.persist_every = 3600.0
    runner._last_persist = time.monotonic()
    job = runner.submit("t", EXAMPLES, method="routing", steps=4, seed=0)
    runner.step()
    runner.step()
    runner.flush()
    persisted = Job.from_json(store.get_job(job.id))
    assert persisted.status == "running" and persisted.progress == 0.0  # only the transition to running was written
    assert runner.get(job.id).progress == 0.5
    runner.persist_every = 0.0
    runner.step()
    runner.flush()
    assert Job.from_json(store.get_job(job.id)).progress == 0.75


def test_the_result_record_names_the_job_and_a_store_error_fails_it(store, monkeypatch):
    runner, _ = make_runner(store, steps=2)
    job = runner.submit("t", EXAMPLES, method="retrieve", steps=2, seed=0)
    run_to_end(runner)
    record = store.get_task("t")
    assert record.source == {"job_id": job.id, "n_examples": 1, "method": "retrieve"}
    assert record.method == "retrieve" and record.metrics == {"exact_match": 0.75}

    def broken(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(store, "put_routing", broken)
    failing = runner.submit("u", EXAMPLES, method="routing", steps=2, seed=0)
    run_to_end(runner)
    failed = runner.get(failing.id)
    assert failed.status == "failed" and failed.error == {"type": "store_error", "message": "no space left on device"}
    assert store.get_task("u").status == "failed" and runner.pending == 0 and not runner.step()


def test_a_result_without_metrics_is_committed(store):
    class Bare:
        def __init__(self) -> None:
            self.kind, self.tensors = "routing", {"logits": torch.ones(1, 1, 2)}

    made: list = []

    def factory(job, examples, progress):
        made.append(FakeAdaptation(1, progress))
        made[-1].result = Bare
        return made[-1]

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=1, seed=0)
    run_to_end(runner)
    assert runner.get(job.id).status == "succeeded" and store.get_task("t").metrics == {}


def test_submit_records_the_job_and_its_placeholder_as_asked(store):
    changed: list = []
    runner, _ = make_runner(store, changed=changed)
    before = time.time()
    job = runner.submit("t", EXAMPLES, method="retrieve", steps=7, seed=3, tenant="acme", shared=True)
    persisted = Job.from_json(store.get_job(job.id))
    for j in (job, persisted):
        assert (j.steps, j.seed, j.n_examples, j.owner, j.serve_early, j.tenant) == (7, 3, 1, "r1", False, "acme")
        assert [(e["type"], e["message"]) for e in j.events] == [("status", "job queued: 1 examples, method retrieve")]
    record = store.get_task("t")
    assert (record.method, record.status, record.job_id, record.owner, record.shared) == (
        "retrieve", "training", job.id, "acme", True)
    assert before <= record.created_at == record.updated_at <= time.time()
    fleet = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False,
                      on_task_changed=changed.append)
    queued = fleet.submit("u", EXAMPLES, method="routing", steps=2, seed=0, serve_early=True)
    assert queued.events[0]["message"] == "job queued: 1 examples, method routing (for the fleet's workers)"
    assert queued.serve_early and store.get_task("u").shared is False
    assert queued.id not in fleet.journal._io and changed == ["t", "u"]


def test_a_job_taken_off_the_queue_still_counts_as_pending_before_its_build_starts(store, monkeypatch):
    """The queued-jobs limit reads `pending` under the service's lock while step() runs on the
    engine thread: between taking the job off the queue and handing it to the builder, a POST
    must still see it, or a burst can queue one job more than POLYSERVE_MAX_QUEUED_JOBS."""
    runner, _ = make_runner(store)
    runner.submit("counted", EXAMPLES, method="routing", steps=3, seed=0)
    assert runner.pending == 1
    seen: list[int] = []
    original = runner._cancelled_elsewhere

    def look(job):  # called by step() after the job left the queue, before the build is submitted
        seen.append(runner.pending)
        return original(job)

    monkeypatch.setattr(runner, "_cancelled_elsewhere", look)
    runner.step()
    assert seen and seen[0] == 1, seen
    assert run_to_end(runner) >= 1 and runner.pending == 0


def test_a_lora_result_is_committed_with_the_jobs_source_method_and_metrics(store):
    """A method that trains a plain LoRA (mu, full) commits "<layer>.A" / "<layer>.B" tables, not a
    routing row: the task's version is a "lora" adapter holding exactly those tables, naming the job."""
    tables = {"m.q.A": torch.full((2, 1), 0.5), "m.q.B": torch.full((1, 2), 2.0)}
    made: list = []

    def factory(job, examples, progress):
        made.append(FakeAdaptation(2, progress))
        made[-1].result = lambda: FakeResult(kind="lora", tensors=dict(tables), metrics={"exact_match": 0.5})
        return made[-1]

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("own", EXAMPLES, method="mu", steps=2, seed=0)
    run_to_end(runner)
    done = runner.get(job.id)
    assert done.status == "succeeded" and done.live_version == 1 and done.metrics["exact_match"] == 0.5
    record = store.get_task("own")
    assert (record.id, record.kind, record.status, record.version, record.method, record.job_id) == (
        "own", "lora", "ready", 1, "mu", job.id)
    assert record.source == {"job_id": job.id, "n_examples": 1, "method": "mu"}
    assert record.metrics == {"exact_match": 0.5}
    weights = store.load_weights(record)
    assert sorted(weights) == ["m.q.A", "m.q.B"] and all(torch.equal(weights[k], tables[k]) for k in tables)


@pytest.mark.parametrize("raised", [ValueError("example 3 has no output"),
                                    StoreUnavailable("PostgreSQL store: connection lost")])
def test_a_build_that_raises_fails_the_job_with_its_error(store, raised):
    """Reading or tokenising the examples fails: the job fails "adaptation_error" with the error's
    message, and so does its placeholder task. A store outage fails it too when the job is this
    replica's own (no lease: nobody else would run it), and no slice is spent on it."""

    def factory(job, examples, progress):
        raise raised

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0)
    run_to_end(runner)
    runner.flush()
    message = str(raised)
    for failed in (runner.get(job.id), Job.from_json(store.get_job(job.id))):
        assert failed.status == "failed" and failed.error == {"type": "adaptation_error", "message": message}
    assert store.get_task("t").status == "failed" and store.get_task("t").error == message
    assert runner.pending == 0 and not store.job_lock_path(job.id).exists()


def on_a_thread(fn):
    """fn() on another thread, its result or its exception: a call that blocks fails here (after
    10 s) instead of hanging the test."""
    out: list = []

    def run():
        try:
            out.append(("value", fn()))
        except BaseException as err:  # noqa: BLE001 - re-raised below
            out.append(("error", err))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the call blocked"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def test_a_stuck_job_write_delays_the_job_never_the_slice(store):
    """The I/O thread is stuck in a job write (a slow disk, a store lock held elsewhere): a slice
    waits at most BUILD_WAIT for the hand-off and says work is pending, flush(timeout) gives up,
    and the commit waits its turn behind the stuck write on the one I/O thread."""
    entered, release = threading.Event(), threading.Event()
    writers: list[str] = []
    real_put_job = store.put_job

    def stuck_put_job(data):
        writers.append(threading.current_thread().name)
        if data["status"] == "running" and not entered.is_set():
            entered.set()
            assert release.wait(30)
        real_put_job(data)

    runner, _ = make_runner(store, steps=1)
    job = runner.submit("t", EXAMPLES, method="routing", steps=1, seed=0)
    store.put_job = stuck_put_job  # the submit's own write is done
    try:
        for _ in range(1000):  # built (off the engine thread), running, its one step, the commit handed off
            assert on_a_thread(runner.step) is True
            if runner.get(job.id).status != "queued":
                break
        assert entered.wait(10)
        assert on_a_thread(runner.step) is True  # the commit is not written: pending, not idle
        with pytest.raises(TimeoutError):
            on_a_thread(lambda: runner.flush(timeout=0.05))
        assert store.get_task("t").status == "training"
    finally:
        release.set()
    runner.flush()
    assert runner.step() is False and runner.get(job.id).status == "succeeded"
    assert Job.from_json(store.get_job(job.id)).status == "succeeded" and store.get_task("t").status == "ready"
    assert set(writers) == {"polyserve-job-io_0"}


def test_the_runners_threads_are_named_daemons_that_start_no_openmp_pool(store, monkeypatch):
    """The build, the job writes and the cancel poll each run on the runner's own named thread, and
    each runs torch on one thread (server/infra/openmp.py: no OpenMP pool beside the engine's); the poll
    thread is a daemon, so a process never waits for it to exit."""
    from server.infra import openmp

    chose, polling = [], threading.Event()
    real = openmp.one_thread

    def one_thread():
        chose.append(threading.current_thread().name)
        if threading.current_thread().name == "polyserve-job-cancels":
            polling.set()
        real()

    monkeypatch.setattr(openmp, "one_thread", one_thread)
    built: list[str] = []

    def factory(job, examples, progress):
        built.append(threading.current_thread().name)
        return FakeAdaptation(1, progress)

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0)
    job = runner.submit("t", EXAMPLES, method="routing", steps=1, seed=0)
    run_to_end(runner)
    runner.flush()
    assert runner.get(job.id).status == "succeeded" and polling.wait(10)
    assert built == ["polyserve-job-build_0"]
    assert {"polyserve-job-build_0", "polyserve-job-io_0", "polyserve-job-cancels"} <= set(chose)
    assert runner.cancels.thread is not None and runner.cancels.thread.daemon


def test_a_runners_default_periods_are_the_readmes(store):
    """docs/fleet.md: a cancel through another replica is read every 0.2 s, progress written every 0.5 s."""
    runner = JobRunner(store, lambda *a: None, replica_id="r1")
    assert (runner.cancels.period, runner.persist_every, runner.run_here) == (0.2, 0.5, True)


def test_a_background_write_that_fails_is_logged(store, caplog, monkeypatch):
    """Nobody waits for a progress write or for an early version's commit: when one fails, the
    server log has it, with its exception (the job's own state says the rest)."""
    runner, _ = make_runner(store, steps=3)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0, serve_early=True)
    runner.step()
    runner.flush()

    def full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store, "put_routing", full)
    monkeypatch.setattr(store, "put_job", full)
    caplog.clear()
    runner.commit_early(runner.state.jobs[job.id], FakeResult())  # its commit fails
    runner.flush()
    runner.step()  # a progress write, which fails
    runner.flush()
    logged = [r for r in caplog.records if r.name == "server.jobs.journal" and r.exc_info]
    assert [(r.levelname, str(r.exc_info[1])) for r in logged] == [("ERROR", "disk full"), ("ERROR", "disk full")]


def test_a_store_outage_at_the_commit_is_retried_at_the_next_slice(store, caplog, monkeypatch):
    """The database is away when the weights are committed: the job is not failed (its lease
    outlives a short outage), the failed hand-off is logged with its error, and a later slice
    commits the result."""
    runner, _ = make_runner(store, steps=2)
    job = runner.submit("t", EXAMPLES, method="routing", steps=2, seed=0)
    real, outages = store.put_routing, []

    def once_away(*args, **kwargs):
        if not outages:
            outages.append(1)
            raise StoreUnavailable("PostgreSQL store: connection lost")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "put_routing", once_away)
    caplog.clear()
    run_to_end(runner)
    runner.flush()
    assert outages == [1] and runner.get(job.id).status == "succeeded" and store.get_task("t").version == 1
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failed) == 1 and isinstance(failed[0].exc_info[1], StoreUnavailable)
