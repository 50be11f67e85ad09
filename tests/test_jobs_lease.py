"""The job runner with leased jobs (a worker's runner) on a directory store, with a scripted
adaptation: enqueue-only submit, adopt, exactly-once commit when a job runs twice, give-back."""

from __future__ import annotations

import time

import torch

from adapters_store.errors import StoreUnavailable
from server.jobs.model import Job
from server.jobs.runner import JobRunner
from tests.test_jobs_runner import EXAMPLES, FakeAdaptation, make_runner, run_to_end, store  # noqa: F401


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
