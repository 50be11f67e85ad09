"""The job runner's state machine and persistence, with a scripted adaptation (no model)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from adapters_store.spec import InventorySpec
from adapters_store.store import Store
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
def store(tmp_path) -> Store:
    s = Store(tmp_path / "store")
    s.save_inventory(InventorySpec(n_skills=2, n_heads=1, rank=1, target_modules=("q",)), ["m.q"], [(2, 2)],
                     {"m.q.A": torch.zeros(1, 2, 2, 1), "m.q.B": torch.zeros(1, 2, 1, 2)}, backbone_fingerprint="fp")
    return s


def make_runner(store, fail_at=None, steps=3, changed=None, finished=None):
    made = []

    def factory(job, examples, progress):
        assert examples == [{"input": "a", "output": "b"}]
        made.append(FakeAdaptation(steps, progress, fail_at))
        return made[-1]

    runner = JobRunner(store, factory, replica_id="r1", persist_every=0.0,
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


def test_job_succeeds_and_commits_the_routing(store):
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
    assert "new-task" in changed and [j.status for j in finished] == ["succeeded"]
    assert not store.job_lock_path(job.id).exists()


def test_failure_is_recorded_with_a_clear_error(store):
    runner, _ = make_runner(store, fail_at=1)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0)
    run_to_end(runner)
    failed = runner.get(job.id)
    assert failed.status == "failed" and "NaN" in failed.error["message"]
    assert store.get_task("t").status == "failed"


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
    runner._release_lock(job.id)
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
        f"import fcntl,time;f=open({str(lock)!r},'a+');fcntl.flock(f,fcntl.LOCK_EX);print('locked',flush=True);time.sleep(30)"],
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
    other = Store(store.root)  # another process's view of the same store
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
    runner, made = make_runner(store, steps=10_000)
    runner.cancel_poll_seconds = 0.05
    job = runner.submit("t1", EXAMPLES, method="routing", steps=10_000, seed=0)
    readers: set[str] = set()
    real = store.cancel_requested
    monkeypatch.setattr(store, "cancel_requested",
                        lambda job_id: (readers.add(threading.current_thread().name), real(job_id))[1])
    runner.step()
    Store(store.root).request_cancel(job.id)
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
from adapters_store.store import Store
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

store = Store(root)
if point == "weights-written":  # inside the commit: weights file written, record not yet
    from adapters_store.atomic import atomic_write_bytes
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
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(store.root), point], stdout=subprocess.PIPE, text=True)
    job_id = proc.stdout.readline().strip()
    deadline = time.time() + 30
    while not (store.root / "at-the-point").exists():
        assert proc.poll() is None and time.time() < deadline, "the child never reached the kill point"
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    reopened = Store(store.root)
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
        reader = threading.Thread(target=lambda: answers.append((runner.get(job.id).status, runner.cancel(other.id).status)))
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
    assert runner.forget_finished(older_than=time.time() - 60) == 0 and runner.owns(job.id)
    assert runner.forget_finished(older_than=time.time() + 1) == 1 and not runner.owns(job.id)
    assert runner.get(job.id).status == "succeeded"  # still readable from the store until pruned there


def test_serve_early_version_survives_a_crash_but_is_not_the_jobs_result(store):
    """After a crash mid-training, the early (retrieved) version stays served and the job is
    failed 'interrupted', not 'succeeded': the early version is not the commit point."""
    runner, _ = make_runner(store, steps=10)
    job = runner.submit("t", EXAMPLES, method="routing", steps=10, seed=0, serve_early=True)
    runner.step()
    early = FakeResult(tensors={"logits": torch.full((1, 1, 2), 2.0)}, metrics={"method": "retrieve"})
    runner.commit_early(runner._jobs[job.id], early)
    runner.flush()
    record = store.get_task("t")
    assert record.status == "ready" and record.version == 1 and record.source["stage"] == "early"
    assert runner.get(job.id).live_version == 1
    runner.step()
    runner.flush()  # a dead process writes nothing later: let this one's hand-offs land first
    runner._release_lock(job.id)  # the "crash"
    fresh, _ = make_runner(store)
    assert fresh.recover() == [job.id]
    assert fresh.get(job.id).status == "failed" and fresh.get(job.id).error["type"] == "interrupted"
    assert store.get_task("t").status == "ready" and torch.equal(store.load_routing("t"), torch.full((1, 1, 2), 2.0))


def test_serve_early_then_the_trained_result_is_the_next_version(store):
    runner, _ = make_runner(store, steps=3)
    job = runner.submit("t", EXAMPLES, method="routing", steps=3, seed=0, serve_early=True)
    runner.step()
    runner.commit_early(runner._jobs[job.id], FakeResult(tensors={"logits": torch.full((1, 1, 2), 2.0)}))
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
    assert runner.get(job.id).status == "succeeded"


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
    and the task stays deleted. Real threads and two Store views, many rounds: before the fix the
    cleanup's check and its change were two lock sections, and the loser raised TaskNotFound
    (the job then stayed "running" forever) or re-created the task as "failed"."""
    import threading

    from adapters_store.errors import TaskNotFound
    from adapters_store.records import TaskRecord
    from server.jobs.runner import _mark_task_not_ready

    replica_b = Store(store.root)
    job = Job(id="job-0123456789abcdef", task="t", method="routing", steps=1, seed=0, n_examples=1, owner="a")
    error = None if status == "cancelled" else {"type": "adaptation_error", "message": "loss became NaN"}
    for _ in range(150):
        store.put_record(TaskRecord(id="t", method="routing", status="training", version=0,
                                    created_at=0.0, updated_at=0.0, job_id=job.id))
        barrier, raised = threading.Barrier(2), []

        def cleanup(barrier=barrier, raised=raised):
            barrier.wait()
            try:
                _mark_task_not_ready(store, job, status, error)
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
    from adapters_store.records import TaskRecord
    from server.jobs.runner import _mark_task_not_ready

    job = Job(id="job-0123456789abcdef", task="t", method="routing", steps=1, seed=0, n_examples=1, owner="a")
    other = store.put_routing("t", torch.ones(1, 1, 2), job_id="job-ffffffffffffffff")
    _mark_task_not_ready(store, job, "cancelled", None)
    assert store.get_task("t") == other
    early = store.put_routing("t", torch.ones(1, 1, 2), job_id=job.id, source={"stage": "early"})
    _mark_task_not_ready(store, job, "failed", {"message": "x"})
    assert store.get_task("t") == early
    store.delete_task("t")
    store.put_record(TaskRecord(id="t", method="routing", status="training", version=0,
                                created_at=0.0, updated_at=0.0, job_id=job.id))
    _mark_task_not_ready(store, job, "failed", {"message": "loss became NaN"})
    failed = store.get_task("t")
    assert failed.status == "failed" and failed.error == "loss became NaN"
