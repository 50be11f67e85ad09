"""Runs adaptation jobs inside the server process, one slice at a time between decode steps.

The engine thread calls `step()` once per loop iteration (and repeatedly while idle): each call
runs at most one optimisation step of the current job, so a job never holds the shared model
for longer than one slice and serving continues while a task is being registered. Building a
job (reading its examples, tokenising up to thousands of them, loading retrieval candidates)
runs on a builder thread ("polyserve-job-build"); the engine's slice only waits for it up to
BUILD_WAIT.

`JobRunner` is the face its callers use (server/jobs/service.py, server/fleet/worker/loop.py);
it keeps the slices and the entry points (submit, cancel, adopt) and hands the rest to its parts,
each of which says what it owns and which thread runs it:

    server/jobs/state.py      the memory they share (jobs, queue, current, holds, cancel
                              requests), under one lock that guards memory only
    server/jobs/journal.py    every job write, on one I/O thread ("polyserve-job-io"), in order:
                              records, progress, transitions, the commit under the task's lock,
                              the end of a job and its notifications. The engine thread never
                              writes a file, takes a store lock or talks to Redis: a slice waits
                              for a hand-off at most BUILD_WAIT, then returns
    server/jobs/leases.py     the claims on jobs: a local job's hold, a worker's lease (renewed by
                              `heartbeat()`, lost to another claimer: dropped unwritten)
    server/jobs/cancels.py    the poll thread ("polyserve-job-cancels") that reads another
                              replica's cancel markers into memory, where `step()` looks
    server/jobs/recovery.py   `recover()` at start-up: the jobs whose process died
    server/jobs/contract.py   what the runner asks of an adaptation and what it commits

In a fleet (POLYSERVE_JOBS=off on the replicas) a runner made with `run_here=False` only enqueues
(`submit` persists the job and its placeholder, then `AdapterStore.enqueue_job`), and a worker's
runner takes claimed jobs with `adopt(lease)`: a job that runs twice is committed once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import JobNotFound, StoreUnavailable
from adapters_store.store.job_queue import JobLease
from adapters_store.store.records import MAX_RECORD_EXAMPLES, TaskRecord
from server.infra import openmp
from server.jobs.cancels import CancelPoll
from server.jobs.contract import AdaptationFactory, AdaptationLike, AdaptationResult
from server.jobs.journal import Journal, committed
from server.jobs.leases import LeaseKeeper
from server.jobs.model import Job, new_job_id
from server.jobs.public_errors import public_error
from server.jobs.recovery import recover
from server.jobs.state import RunnerState

log = logging.getLogger(__name__)
# A slice waits at most this long for a job being built (examples read, tokenised, candidates
# loaded) on the builder thread, or for a job write handed to the I/O thread; a larger job keeps
# building, and a slow write keeps being written, while the engine serves.
BUILD_WAIT = 0.05


class JobRunner:
    def __init__(
        self,
        store: AdapterStore,
        make_adaptation: AdaptationFactory,
        *,
        replica_id: str,
        on_task_changed: Callable[[str], None] = lambda task: None,
        on_job_finished: Callable[[Job], None] = lambda job: None,
        persist_every: float = 0.5,
        cancel_poll_seconds: float = 0.2,
        run_here: bool = True,
    ) -> None:
        self.store = store
        self.make_adaptation = make_adaptation
        self.replica_id = replica_id
        self.on_task_changed = on_task_changed
        self.persist_every = persist_every
        self.run_here = run_here  # False: submit() only enqueues, for the fleet's workers
        # the runner's parts (server/jobs/state.py, leases.py, journal.py, cancels.py)
        self.state = RunnerState()
        self.leases = LeaseKeeper(store, self.state)
        self.journal = Journal(store, self.state, self.leases, on_task_changed=on_task_changed,
                               on_job_finished=on_job_finished, slice_wait=BUILD_WAIT)
        # another replica's cancel markers are read by this thread, never by step() (the engine's)
        self.cancels = CancelPoll(store, self.state, cancel_poll_seconds)
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyserve-job-build",
                                           initializer=openmp.one_thread)  # no OpenMP pool beside the engine's
        self._last_persist = 0.0

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        state = self.state
        with state.lock:
            return len(state.queue) + (1 if state.current or state.starting else 0)

    def pending_of(self, tenant: str) -> int:
        """`pending`, of one tenant's jobs only (its per-tenant quota)."""
        state = self.state
        with state.lock:
            running = [held[0] for held in (state.current, state.starting) if held is not None]
            jobs = [state.jobs[i] for i in state.queue] + running
            return sum(1 for job in jobs if job.tenant == tenant)

    def forget_finished(self, older_than: float) -> int:
        """Drop finished jobs that ended before `older_than` from memory (retention)."""
        state = self.state
        with state.lock:
            old = [i for i, j in state.jobs.items() if j.finished and (j.finished_at or 0) < older_than]
            for job_id in old:
                del state.jobs[job_id]
                self.journal.forget(job_id)
        return len(old)

    def owns(self, job_id: str) -> bool:
        with self.state.lock:
            return job_id in self.state.jobs

    def get(self, job_id: str) -> Job:
        with self.state.lock:
            if job_id in self.state.jobs:
                return Job.from_json(self.state.jobs[job_id].to_json())
        return Job.from_json(self.store.get_job(job_id))

    # -- API ----------------------------------------------------------------------------------
    def submit(
        self, task: str, examples: list[dict[str, str]], *, method: str, steps: int | None, seed: int | None,
        serve_early: bool = False, tenant: str | None = None, shared: bool = False, description: str | None = None,
    ) -> Job:
        """Persist the job and a "training" registry entry, then queue it. The caller has
        validated the examples and checked that the task id is free. tenant / shared: the task's
        owner and whether every tenant may use it (server/registry/ownership.py); description and the
        first examples are what the task says of itself (its record keeps them through versions)."""
        job = Job(id=new_job_id(), task=task, method=method, steps=steps, seed=seed,
                  n_examples=len(examples), owner=self.replica_id, serve_early=serve_early, tenant=tenant)
        job.add_event("status", f"job queued: {len(examples)} examples, method {method}"
                      + ("" if self.run_here else " (for the fleet's workers)"))
        if self.run_here:
            self.leases.hold(job.id)
            self.cancels.start()
        self.store.put_job_examples(job.id, examples)
        self.journal.persist(job)
        now = time.time()
        self.store.put_record(TaskRecord(id=task, method=method, status="training", version=0,
                                         created_at=now, updated_at=now, job_id=job.id, owner=tenant,
                                         shared=shared, description=description,
                                         examples=[{"input": e["input"], "output": e["output"]}
                                                   for e in examples[:MAX_RECORD_EXAMPLES]]))
        if not self.run_here:  # last: a worker that claims it finds its examples and placeholder
            self.store.enqueue_job(job.id)
            with self.state.lock:
                self.journal.forget(job.id)
            self.on_task_changed(task)
            return Job.from_json(job.to_json())
        with self.state.lock:
            self.state.jobs[job.id] = job
            self.state.queue.append(job.id)
        self.on_task_changed(task)
        return Job.from_json(job.to_json())

    def cancel(self, job_id: str) -> Job:
        state = self.state
        with state.lock:
            job = state.jobs.get(job_id)
            if job is not None and not job.finished:
                if job_id in state.queue:
                    state.queue.remove(job_id)
                    self.journal.finish(job, "cancelled")
                else:
                    state.cancel_requested.add(job_id)  # the running slice stops at its next step
                    job.add_event("status", "cancellation requested")
        self.journal.settle()
        return self.get(job_id)

    def cancel_unclaimed(self, job_id: str, lease_seconds: float) -> Job | None:
        """A job waiting in the fleet's queue that no worker holds (or whose worker's lease ran out):
        claimed and adopted here as a worker would (so a job found finished or already committed is
        settled as such), then cancelled at once: placeholder task removed, queue entry gone.
        None when a live worker holds it (its cancel marker reaches it) or it left the queue."""
        lease = self.store.claim_job(self.replica_id, lease_seconds, job_id=job_id)
        if lease is None:
            return None
        if self.adopt(lease) is None:  # pruned, finished or committed meanwhile: settled by adopt
            try:
                return self.get(job_id)
            except JobNotFound:
                return None
        return self.cancel(job_id)

    def commit_early(self, job: Job, result: AdaptationResult) -> None:
        """serve_early: the retrieved routing becomes the task's first version, servable at once,
        while training goes on (called from the job's slice, on the engine thread: the commit
        itself is written by the I/O thread, before the job's final commit)."""
        self.journal.commit_early(job, result)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every hand-off so far is done (tests, shutdown)."""
        self.journal.flush(timeout)

    def check_cancels(self) -> int:
        """Read the store's cancel markers of this runner's unfinished jobs into memory, where
        step() looks (server/jobs/cancels.py). Returns how many are newly seen."""
        return self.cancels.check()

    # -- a worker's jobs: claimed from the store's queue ------------------------------------------
    def adopt(self, lease: JobLease, *, max_attempts: int | None = None) -> Job | None:
        """Take a job claimed from the queue (`AdapterStore.claim_job`): its lease is its hold. A job that
        finished, or whose result an earlier run committed, is settled without running; one tried
        more than `max_attempts` times fails. Returns the job queued here, else None."""
        try:
            job = Job.from_json(self.store.get_job(lease.job_id))
        except JobNotFound:
            lease.release()  # pruned: nothing to run
            return None
        if job.finished:
            lease.release()  # its last runner died after saying so, before dropping the entry
            return None
        job.owner = self.replica_id
        with self.state.lock:
            self.state.jobs[job.id] = job
            self.state.holds[job.id] = lease
        self.cancels.start()
        try:
            return self._adopt(job, lease, max_attempts)
        except Exception:
            self.state.drop(job)  # unwritten: its lease expires, and the job is claimed again
            raise

    def _adopt(self, job: Job, lease: JobLease, max_attempts: int | None) -> Job | None:
        state = self.state
        cancelled, done = self.store.cancel_requested(job.id), committed(self.store, job)
        if cancelled:
            with state.lock:
                state.cancel_requested.add(job.id)
        if done:  # an earlier run was killed after the commit point, before the job said so
            with state.lock:
                job.add_event("status", "the result was committed by an earlier run of this job")
                if job.status == "queued":
                    job.transition("running")
                self.journal.finish(job, "succeeded")
            self.journal.settle()
            return None
        if max_attempts is not None and lease.attempts > max_attempts:
            with state.lock:
                self.journal.finish(job, "failed", {"type": "interrupted", "message": f"interrupted: the job's "
                                    f"runner stopped {lease.attempts - 1} times (POLYSERVE_JOB_MAX_ATTEMPTS)"})
            self.journal.settle()
            return None
        with state.lock:
            job.add_event("status", f"claimed by {self.replica_id} (attempt {lease.attempts})",
                          attempt=lease.attempts)
            state.queue.append(job.id)
        self.journal.persist(job)
        return Job.from_json(job.to_json())

    def heartbeat(self) -> list[str]:
        """Renew the leases of this runner's jobs (server/jobs/leases.py); a job whose lease
        another claimer took over is dropped at its next slice. Returns the ids of the jobs lost."""
        return self.leases.heartbeat()

    def lose(self, job_id: str) -> None:
        """Another claimer runs the job now: stop it at the next slice and write nothing."""
        self.leases.lose(job_id)

    def give_back(self) -> None:
        """Stopping: every job held by a lease becomes claimable again at once (unwritten)."""
        self.leases.give_back()

    # -- the slice the engine runs ------------------------------------------------------------
    def _cancelled_elsewhere(self, job: Job) -> bool:
        with self.state.lock:
            return job.id in self.state.cancel_requested

    def step(self) -> bool:
        """Run one slice of the current job (starting the next queued one if needed).
        Returns True if any work was done (or a job is being prepared)."""
        if self.journal.busy():  # a commit or the end of a job is being written
            return True
        state, journal = self.state, self.journal
        with state.lock:
            if state.current is None and state.starting is None:
                if not state.queue:
                    return False
                job = state.jobs[state.queue.popleft()]
                # counted by `pending` from the moment it leaves the queue: a POST between this and
                # the builder's start must not see a free place in the queue limit
                state.starting = (job, None)
                start = True
            elif state.current is None:
                starting = state.starting
                assert starting is not None  # not both None: the branch above
                job, pending_future = starting
                assert pending_future is not None  # set in the same step() that took the job
                future = pending_future
                start = False
            else:
                job, adaptation = state.current
                start = False
            lost = job.id in state.lost
            running = state.current is not None
        if lost:
            if running:
                adaptation.cancel()
            return state.drop(job)
        if start and self._cancelled_elsewhere(job):  # cancelled here, or through another replica
            with state.lock:
                state.starting = None
            return journal.finish_later(job, "cancelled")
        if start:  # reading examples, tokenising, loading candidates: off the engine thread
            future = self._builder.submit(self._build, job)
            with state.lock:
                state.starting = (job, future)
        if state.current is None:
            wait([future], timeout=BUILD_WAIT)  # a bounded slice: the engine keeps serving meanwhile
            if not future.done():
                return True
            with state.lock:
                state.starting = None
            try:
                adaptation = future.result()
            except StoreUnavailable as err:
                if self.leases.leased(job.id):  # a leased job: another claim runs it
                    log.warning("job %s not started, the store is away (%s); given back", job.id, err)
                    return journal.offload(lambda: self.leases.give_back_one(job))
                log.exception("job %s failed to start", job.id)
                return journal.finish_later(job, "failed", public_error("adaptation_error", err))
            except Exception as err:
                log.exception("job %s failed to start", job.id)
                return journal.finish_later(job, "failed", public_error("adaptation_error", err))
            with state.lock:
                job.transition("running")
                state.current = (job, adaptation)
            journal.write_later(job)
        if self._cancelled_elsewhere(job):
            adaptation.cancel()
            with state.lock:
                state.current = None
            return journal.finish_later(job, "cancelled")
        try:
            more = adaptation.step()
            if not more:
                result = adaptation.result()
        except Exception as err:
            log.exception("job %s failed", job.id)
            with state.lock:
                state.current = None
            return journal.finish_later(job, "failed", public_error("adaptation_error", err))
        if not more:
            return journal.offload(lambda: journal.commit(job, result))
        return True

    def _build(self, job: Job) -> AdaptationLike:
        """On the builder thread: the job's examples and its adaptation (tokenised, ready)."""
        examples = self.store.get_job_examples(job.id)
        return self.make_adaptation(job, examples, lambda p: self._progress(job, p))

    def _progress(self, job: Job, info: dict[str, Any]) -> None:
        with self.state.lock:
            steps = info.get("steps") or job.steps
            if steps:
                job.progress = min(0.999, float(info.get("step", 0)) / float(steps))
            numbers = {k: v for k, v in info.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            job.metrics.update(numbers)
            if info.get("phase") == "eval":
                job.add_event("metrics", f"step {info.get('step')}: eval loss {info.get('eval_loss')}",
                              "info", **numbers)
            due = time.monotonic() - self._last_persist >= self.persist_every
            if due:
                self._last_persist = time.monotonic()
        if due:
            self.journal.write_later(job)

    # -- start-up -----------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Every unfinished job whose owner process is gone: succeeded if its result was committed
        (the task record names it), else failed ("interrupted"). Returns their ids
        (server/jobs/recovery.py)."""
        return recover(self.store, self.state, self.journal, self.on_task_changed)
