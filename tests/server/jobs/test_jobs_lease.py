"""The job runner with leased jobs (a worker's runner) on a directory store, with a scripted
adaptation: enqueue-only submit, adopt, exactly-once commit when a job runs twice, give-back."""

from __future__ import annotations

import time

import pytest
import torch

from adapters_store.store.errors import StoreUnavailable
from server.jobs.model import Job
from server.jobs.runner import JobRunner
from tests.server.jobs.test_jobs_runner import EXAMPLES, FakeAdaptation, make_runner, run_to_end, store  # noqa: F401


def worker(store, name: str, made: list, steps: int = 3) -> JobRunner:  # noqa: F811
    def factory(job, examples, progress):
        made.append(FakeAdaptation(steps, progress))
        return made[-1]

    return JobRunner(store, factory, replica_id=name, persist_every=0.0)


def test_an_enqueue_only_runner_holds_nothing_and_a_worker_runs_the_job(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("leased", EXAMPLES, method="routing", steps=3, seed=0)
    assert store.job_enqueued(job.id) and replica.pending == 0 and not replica.step()
    assert replica.recover() == []  # a queued job is the workers': its lease says whether its runner lives
    made: list = []
    w = worker(store, "w1", made)
    assert w.adopt(store.claim_job("w1", 30)) is not None
    run_to_end(w)
    w.flush()
    done = Job.from_json(store.get_job(job.id))
    assert done.status == "succeeded" and done.owner == "w1"
    assert store.get_task("leased").version == 1 and not store.job_enqueued(job.id)


def test_a_job_that_runs_twice_is_committed_once(store):  # noqa: F811
    """w1's lease expires while it trains; w2 claims the job, runs it and commits. w1's commit then
    finds its lease gone and writes nothing (no version 2, the job stays succeeded)."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("twice", EXAMPLES, method="routing", steps=3, seed=0)
    made1: list = []
    w1 = worker(store, "w1", made1)
    w1.adopt(store.claim_job("w1", 0.2))
    w1.flush()
    assert w1.step() and w1.step()  # built and running, not finished
    time.sleep(0.3)  # w1 stops heart-beating
    made2: list = []
    w2 = worker(store, "w2", made2)
    w2.adopt(store.claim_job("w2", 30))
    run_to_end(w2)
    w2.flush()
    assert store.get_task("twice").version == 1
    run_to_end(w1)  # w1 finishes its steps and tries to commit
    w1.flush()
    assert store.get_task("twice").version == 1
    assert Job.from_json(store.get_job(job.id)).status == "succeeded"
    assert w1.pending == 0 and not w1.owns(job.id)


def test_a_run_that_finds_the_result_committed_settles_the_job_without_running(store):  # noqa: F811
    """The last run was killed after the commit point (the task names the job), before the job
    said succeeded: the next claim marks it succeeded and trains nothing."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("committed", EXAMPLES, method="routing", steps=3, seed=0)
    store.put_routing("committed", torch.ones(1, 1, 2), job_id=job.id)  # the killed run's commit
    made: list = []
    w = worker(store, "w2", made)
    assert w.adopt(store.claim_job("w2", 30)) is None
    w.flush()
    assert made == [] and Job.from_json(store.get_job(job.id)).status == "succeeded"
    assert store.get_task("committed").version == 1 and not store.job_enqueued(job.id)


def test_a_store_outage_while_a_leased_job_is_built_gives_it_back_instead_of_failing_it(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("outage", EXAMPLES, method="routing", steps=3, seed=0)

    def factory(job, examples, progress):
        raise StoreUnavailable("PostgreSQL store: connection lost")

    w = JobRunner(store, factory, replica_id="w1", persist_every=0.0)
    w.adopt(store.claim_job("w1", 30))
    run_to_end(w)
    w.flush()
    assert Job.from_json(store.get_job(job.id)).status != "failed"
    assert store.get_task("outage").status == "training"
    again = store.claim_job("w2", 30)  # claimable again at once, not after the lease
    assert again is not None and again.job_id == job.id and again.attempts == 2


def test_a_job_claimed_too_often_fails_and_a_claim_is_an_event(store):  # noqa: F811
    """max_attempts is the most claims a job gets: the 3rd of 3 runs (its claim is an event naming
    the worker and the attempt), the 4th fails it "interrupted", naming the 3 runs that stopped.
    give_back() makes a leased job claimable again at once."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("tries", EXAMPLES, method="routing", steps=3, seed=0)
    for _ in range(2):
        store.claim_job("gone", 30).give_back()
    made: list = []
    w = worker(store, "w1", made)
    third = store.claim_job("w1", 30)
    assert third.attempts == 3 and w.adopt(third, max_attempts=3) is not None
    claimed = [e for e in w.get(job.id).events if e["message"].startswith("claimed")]
    assert [(e["type"], e["message"], e["data"]) for e in claimed] == [
        ("status", "claimed by w1 (attempt 3)", {"attempt": 3})]
    w.give_back()
    fourth = store.claim_job("w2", 30)
    assert fourth is not None and fourth.attempts == 4
    w2 = worker(store, "w2", [])
    assert w2.adopt(fourth, max_attempts=3) is None
    w2.flush()
    failed = Job.from_json(store.get_job(job.id))
    assert failed.status == "failed" and failed.error == {
        "type": "interrupted",
        "message": "interrupted: the job's runner stopped 3 times (POLYSERVE_JOB_MAX_ATTEMPTS)"}
    assert store.get_task("tries").status == "failed" and made[:1] == []


def test_a_claim_that_finds_the_result_committed_says_so_in_an_event(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("said", EXAMPLES, method="routing", steps=3, seed=0)
    store.put_routing("said", torch.ones(1, 1, 2), job_id=job.id)
    w = worker(store, "w2", [])
    assert w.adopt(store.claim_job("w2", 30)) is None
    w.flush()
    events = Job.from_json(store.get_job(job.id)).events
    assert ("status", "the result was committed by an earlier run of this job") in [
        (e["type"], e["message"]) for e in events]


class _Unreachable:
    def renew(self) -> bool:
        raise StoreUnavailable("connection lost")


def test_heartbeat_renews_leases_and_drops_a_lost_job_unwritten(store):  # noqa: F811
    """A beat keeps a short lease alive past its length; one that fails for a store outage is tried
    again next beat and the others are still renewed; a lease another worker took is reported and
    its run stops at the next slice (the adaptation not stepped again, nothing written)."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("beat", EXAMPLES, method="routing", steps=5, seed=0)
    made: list = []
    w = worker(store, "w1", made, steps=5)
    w.state.holds["job-00000000000000ff"] = _Unreachable()  # an outage on the first lease renewed
    w.adopt(store.claim_job("w1", 0.4))
    w.flush()
    assert w.step() and w.step()  # built and running
    for _ in range(3):
        time.sleep(0.2)
        assert w.heartbeat() == []
    assert store.claim_job("w2", 30) is None  # renewed: still w1's
    del w.state.holds["job-00000000000000ff"]
    w.state.holds = {"job-00000000000000ff": _Unreachable(), **w.state.holds}
    lease = w.state.holds[job.id]
    time.sleep(0.6)  # w1 stops beating; w2 takes the job over
    assert store.claim_job("w2", 30) is not None and not lease.still_held()
    assert w.heartbeat() == [job.id]
    w.flush()
    before = made[0].done
    assert w.step()  # the slice that drops it
    run_to_end(w)
    assert made[0].cancelled and made[0].done == before and not w.owns(job.id) and w.pending == 0
    assert w.heartbeat() == []  # the dropped lease is no longer renewed
    assert Job.from_json(store.get_job(job.id)).status == "running" and store.get_task("beat").version == 0


def test_a_job_lost_while_it_is_built_never_runs(store):  # noqa: F811
    import threading

    release = threading.Event()
    made: list = []

    def factory(job, examples, progress):
        release.wait(5)
        made.append(FakeAdaptation(3, progress))
        return made[-1]

    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("built", EXAMPLES, method="routing", steps=3, seed=0)
    w = JobRunner(store, factory, replica_id="w1", persist_every=0.0)
    w.adopt(store.claim_job("w1", 30))
    w.flush()
    assert w.step()  # building, not done
    w.lose(job.id)
    assert w.step()  # dropped
    release.set()
    w._builder.submit(lambda: None).result(5)
    run_to_end(w)
    assert all(a.done == 0 for a in made) and not w.owns(job.id) and w.pending == 0


def test_a_failed_write_while_adopting_leaves_nothing_queued(store, monkeypatch):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("disk", EXAMPLES, method="routing", steps=3, seed=0)
    w = worker(store, "w1", [])
    lease = store.claim_job("w1", 30)

    def full(*args):
        raise OSError("disk full")

    monkeypatch.setattr(store, "put_job_if_held", full)  # a leased run writes through its lease
    with pytest.raises(OSError, match="disk full"):
        w.adopt(lease)
    assert w.pending == 0 and not w.owns(job.id) and not w.step()


def test_a_claimed_job_with_a_cancel_marker_is_cancelled_without_being_built(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("gone", EXAMPLES, method="routing", steps=3, seed=0)
    store.request_cancel(job.id)
    made: list = []
    w = worker(store, "w1", made)
    w.adopt(store.claim_job("w1", 30))
    run_to_end(w)
    w.flush()
    assert made == [] and Job.from_json(store.get_job(job.id)).status == "cancelled" and not store.has_task("gone")


def test_a_queued_job_no_worker_holds_is_cancelled_at_once_by_any_replica(store):  # noqa: F811
    """Catches: a cancel through a serving replica that only leaves a marker, so the job reads
    "queued" (and its placeholder task stays) until some worker claims it, forever with none up."""
    submitter = JobRunner(store, lambda *a: None, replica_id="a", run_here=False)
    job = submitter.submit("unclaimed", EXAMPLES, method="routing", steps=3, seed=0)
    other = JobRunner(store, lambda *a: None, replica_id="b", run_here=False)
    done = other.cancel_unclaimed(job.id, 30)
    assert done is not None and done.status == "cancelled"
    stored = Job.from_json(store.get_job(job.id))
    assert stored.status == "cancelled" and stored.finished_at is not None
    assert not store.has_task("unclaimed") and not store.job_enqueued(job.id)
    assert store.claim_job("w1", 30) is None  # no worker will ever run it


def test_a_cancel_that_finds_the_result_committed_settles_the_job_succeeded(store):  # noqa: F811
    """A worker was killed after its commit, before the job said so: cancelling it now must not
    call cancelled a job whose task is served with its result."""
    replica = JobRunner(store, lambda *a: None, replica_id="a", run_here=False)
    job = replica.submit("late", EXAMPLES, method="routing", steps=3, seed=0)
    store.put_routing("late", torch.ones(1, 1, 2), job_id=job.id)  # the killed run's commit
    done = replica.cancel_unclaimed(job.id, 30)
    assert done is not None and done.status == "succeeded"
    assert Job.from_json(store.get_job(job.id)).status == "succeeded" and store.get_task("late").version == 1
    assert not store.job_enqueued(job.id)


def test_a_replica_cannot_cancel_at_once_a_job_a_worker_holds(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="a", run_here=False)
    job = replica.submit("held", EXAMPLES, method="routing", steps=3, seed=0)
    made: list = []
    w = worker(store, "w1", made)
    w.adopt(store.claim_job("w1", 30))
    assert replica.cancel_unclaimed(job.id, 30) is None  # the marker path: the worker stops it
    assert store.job_enqueued(job.id) and store.has_task("held")
    run_to_end(w)
    w.flush()
    assert Job.from_json(store.get_job(job.id)).status == "succeeded" and store.get_task("held").version == 1


def test_a_worker_that_lost_a_job_can_claim_and_run_it_again(store):  # noqa: F811
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("again", EXAMPLES, method="routing", steps=2, seed=0)
    made: list = []
    w = worker(store, "w1", made, steps=2)
    w.adopt(store.claim_job("w1", 0.2))
    w.flush()
    time.sleep(0.3)
    assert store.claim_job("w2", 0.2) is not None  # w2 takes it over, then dies too
    assert w.heartbeat() == [job.id]
    run_to_end(w)
    assert not w.owns(job.id)
    time.sleep(0.3)
    assert w.adopt(store.claim_job("w1", 30)) is not None
    run_to_end(w)
    w.flush()
    assert Job.from_json(store.get_job(job.id)).status == "succeeded" and store.get_task("again").version == 1


def test_the_next_job_is_built_only_once_a_dropped_jobs_build_returns(store):  # noqa: F811
    """One build at a time beside the engine: a job lost while it is built is dropped at once, and
    the next job's build waits on the one builder thread until the abandoned build returns."""
    import threading

    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    ids = [replica.submit(task, EXAMPLES, method="routing", steps=1, seed=0).id for task in ("one", "two")]
    release, built = threading.Event(), []

    def factory(job, examples, progress):
        built.append((job.id, threading.current_thread().name))
        if len(built) == 1:  # the first build hangs (a slow read of the examples)
            assert release.wait(30)
        return FakeAdaptation(1, progress)

    w = JobRunner(store, factory, replica_id="w1", persist_every=0.0)
    for _ in ids:
        w.adopt(store.claim_job("w1", 30))
    w.flush()
    while not built:
        assert w.step()  # the first adopted job is being built
    lost = built[0][0]
    w.lose(lost)
    for _ in range(3):
        assert w.step()  # dropped; the other job's build is handed to the builder and waits
    assert len(built) == 1
    release.set()
    run_to_end(w, limit=1000)
    other = next(job_id for job_id in ids if job_id != lost)
    assert built == [(lost, "polyserve-job-build_0"), (other, "polyserve-job-build_0")]
    assert not w.owns(lost) and w.get(other).status == "succeeded" and w.pending == 0


def test_a_progress_write_that_finds_the_lease_taken_over_writes_nothing_and_the_run_stops(store):  # noqa: F811
    """Another worker took the job over: this run's next progress write, which checks the lease
    just before writing, writes nothing, and the slice after it drops the run (the adaptation
    cancelled, not stepped again)."""
    replica = JobRunner(store, lambda *a: None, replica_id="replica", run_here=False)
    job = replica.submit("stale", EXAMPLES, method="routing", steps=5, seed=0)
    made: list = []
    w1 = worker(store, "w1", made, steps=5)
    w1.adopt(store.claim_job("w1", 0.2))
    for _ in range(1000):
        w1.flush()
        if made and made[0].done:
            break
        assert w1.step()  # built, running, one step
    w1.flush()
    before = store.get_job(job.id)
    time.sleep(0.3)  # w1 stops heart-beating; w2 takes the job over
    assert store.claim_job("w2", 30) is not None
    assert w1.step()  # one more step: its progress write finds the lease gone
    w1.flush()
    stepped = made[0].done
    assert w1.step()  # dropped
    run_to_end(w1)
    assert made[0].cancelled and made[0].done == stepped == 2 and not w1.owns(job.id) and w1.pending == 0
    assert store.get_job(job.id) == before
