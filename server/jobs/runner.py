"""Runs adaptation jobs inside the server process, one slice at a time between decode steps.

The engine thread calls `step()` once per loop iteration (and repeatedly while idle): each call
runs at most one optimisation step of the current job, so a job never holds the shared model
for longer than one slice and serving continues while a task is being registered. Building a
job (reading its examples, tokenising up to thousands of them, loading retrieval candidates)
runs on a builder thread; the engine's slice only waits for it up to BUILD_WAIT.

Persistence: the job record (store/jobs/<id>.json) is rewritten atomically on every transition
and at most every `persist_every` seconds while running; the task's registry entry says
"training" until the weights are committed. The process running a job holds the store's claim on
it (`AdapterStore.hold_job`: an fcntl lock in a directory store, an advisory lock on its own connection in
PostgreSQL; both end with the process), so `recover()` (at start-up, any replica) can tell a job
whose process died — claim free, status not terminal — and mark it failed with reason "interrupted".

The engine thread never writes a file, takes a store lock or talks to Redis: `step()` hands every
job write (progress, transitions, the commit under the task's lock, the end of a job and its
notifications) to one I/O thread, in order. While such a hand-off is unfinished, `step()` waits
for it at most BUILD_WAIT and otherwise returns at once, so a store lock held elsewhere or a slow
disk delays the job, never decoding. Another replica's cancel markers are read by a poll thread
(`check_cancels`, every `cancel_poll_seconds`) into memory, where `step()` looks.

In a fleet (POLYSERVE_JOBS=off on the replicas) a runner made with `run_here=False` only enqueues
(`submit` persists the job and its placeholder, then `AdapterStore.enqueue_job`), and a worker's runner
takes claimed jobs with `adopt(lease)`: the lease is the job's hold, renewed by `heartbeat()`. A
job whose lease another worker took over is dropped without a write (`lose`), and `_commit`
checks, under the task's lock, that the lease is still held and that no earlier run of the job
committed its result: a job that runs twice is committed once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from adapters_store.store.contract import AdapterStore, JobHold
from adapters_store.store.errors import JobNotFound, StoreUnavailable, TaskNotFound
from adapters_store.store.job_queue import JobLease
from adapters_store.store.records import TaskRecord
from server.infra import openmp
from server.jobs.model import Job, new_job_id
from server.jobs.public_errors import public_error

log = logging.getLogger(__name__)
# A slice waits at most this long for a job being built (examples read, tokenised, candidates
# loaded) on the builder thread; a larger job keeps building while the engine serves.
BUILD_WAIT = 0.05


class AdaptationLike(Protocol):
    def step(self) -> bool: ...
    def cancel(self) -> None: ...
    def result(self) -> Any: ...


# (job, examples as dicts, progress callback) -> a steppable adaptation
AdaptationFactory = Callable[[Job, list[dict[str, str]], Callable[[dict[str, Any]], None]], AdaptationLike]


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
        self.on_job_finished = on_job_finished
        self.persist_every = persist_every
        self.cancel_poll_seconds = cancel_poll_seconds
        self.run_here = run_here  # False: submit() only enqueues, for the fleet's workers
        self._lost: set[str] = set()  # jobs whose lease another claimer took over: dropped unwritten
        self._lock = threading.Lock()  # in-memory state only: no file or Redis I/O under it
        self._io: dict[str, threading.Lock] = {}  # per job: its file writes in order
        self._done: list[tuple[Job, str, dict[str, str] | None]] = []  # finished, not yet settled
        self._queue: deque[str] = deque()
        self._jobs: dict[str, Job] = {}
        self._holds: dict[str, JobHold] = {}
        self._current: tuple[Job, AdaptationLike] | None = None
        # being built on the builder thread (the future is None only inside the step() that took it)
        self._starting: tuple[Job, Future | None] | None = None
        self._builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyserve-job-build",
                                           initializer=openmp.one_thread)  # no OpenMP pool beside the engine's
        self._cancel_requested: set[str] = set()
        self._last_persist = 0.0
        # job writes handed off by the engine thread (step), one at a time, in order
        self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyserve-job-io",
                                           initializer=openmp.one_thread)
        self._busy: Future | None = None  # the last hand-off step() must see done before going on
        # another replica's cancel markers are read by this thread, never by step() (the engine's)
        self._poller: threading.Thread | None = None

    # -- bookkeeping ------------------------------------------------------------------------
    def _persist(self, job: Job) -> None:
        """Write the job's latest state. Never called under `_lock`: the lock only guards memory
        (a GET of a job must not wait on an fsync); a per-job I/O lock keeps one job's writes in
        order (the snapshot is taken under it, so a later write always carries a later state).
        A leased job's run writes only while its lease is still its own (the check and the write
        are one step of the store): once another worker took the job over, this run's stale state
        must not overwrite that worker's."""
        with self._lock:
            io = self._io.setdefault(job.id, threading.Lock())
            hold = self._holds.get(job.id)
        with io:
            with self._lock:
                data = job.to_json()
            token = getattr(hold, "token", None)  # a JobLease's; a local job's hold has none
            if token is None:
                self.store.put_job(data)
            elif not self.store.put_job_if_held(data, token):
                self.lose(job.id)

    def _hold_lock(self, job_id: str) -> None:
        hold = self.store.hold_job(job_id)  # a new id: nobody else can hold it
        if hold is None:
            raise RuntimeError(f"job {job_id} is already claimed by another process")
        self._holds[job_id] = hold

    def _release_lock(self, job_id: str) -> None:
        hold = self._holds.pop(job_id, None)
        if hold is not None:
            hold.release()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._queue) + (1 if self._current or self._starting else 0)

    def pending_of(self, tenant: str) -> int:
        """`pending`, of one tenant's jobs only (its per-tenant quota)."""
        with self._lock:
            running = [held[0] for held in (self._current, self._starting) if held is not None]
            jobs = [self._jobs[i] for i in self._queue] + running
            return sum(1 for job in jobs if job.tenant == tenant)

    def forget_finished(self, older_than: float) -> int:
        """Drop finished jobs that ended before `older_than` from memory (retention)."""
        with self._lock:
            old = [i for i, j in self._jobs.items() if j.finished and (j.finished_at or 0) < older_than]
            for job_id in old:
                del self._jobs[job_id]
                self._io.pop(job_id, None)
        return len(old)

    def owns(self, job_id: str) -> bool:
        with self._lock:
            return job_id in self._jobs

    def get(self, job_id: str) -> Job:
        with self._lock:
            if job_id in self._jobs:
                return Job.from_json(self._jobs[job_id].to_json())
        return Job.from_json(self.store.get_job(job_id))

    # -- API ----------------------------------------------------------------------------------
    def submit(
        self, task: str, examples: list[dict[str, str]], *, method: str, steps: int | None, seed: int | None,
        serve_early: bool = False, tenant: str | None = None, shared: bool = False,
    ) -> Job:
        """Persist the job and a "training" registry entry, then queue it. The caller has
        validated the examples and checked that the task id is free. tenant / shared: the task's
        owner and whether every tenant may use it (server/registry/ownership.py)."""
        job = Job(id=new_job_id(), task=task, method=method, steps=steps, seed=seed,
                  n_examples=len(examples), owner=self.replica_id, serve_early=serve_early, tenant=tenant)
        job.add_event("status", f"job queued: {len(examples)} examples, method {method}"
                      + ("" if self.run_here else " (for the fleet's workers)"))
        if self.run_here:
            self._hold_lock(job.id)
            self._start_poller()
        self.store.put_job_examples(job.id, examples)
        self._persist(job)
        now = time.time()
        self.store.put_record(TaskRecord(id=task, method=method, status="training", version=0,
                                         created_at=now, updated_at=now, job_id=job.id, owner=tenant,
                                         shared=shared))
        if not self.run_here:  # last: a worker that claims it finds its examples and placeholder
            self.store.enqueue_job(job.id)
            with self._lock:
                self._io.pop(job.id, None)
            self.on_task_changed(task)
            return Job.from_json(job.to_json())
        with self._lock:
            self._jobs[job.id] = job
            self._queue.append(job.id)
        self.on_task_changed(task)
        return Job.from_json(job.to_json())

    def cancel(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and not job.finished:
                if job_id in self._queue:
                    self._queue.remove(job_id)
                    self._finish(job, "cancelled")
                else:
                    self._cancel_requested.add(job_id)  # the running slice stops at its next step
                    job.add_event("status", "cancellation requested")
        self._settle()
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
        with self._lock:
            self._jobs[job.id] = job
            self._holds[job.id] = lease
        self._start_poller()
        try:
            return self._adopt(job, lease, max_attempts)
        except Exception:
            self._drop(job)  # unwritten: its lease expires, and the job is claimed again
            raise

    def _adopt(self, job: Job, lease: JobLease, max_attempts: int | None) -> Job | None:
        cancelled, committed = self.store.cancel_requested(job.id), self._committed(job)
        if cancelled:
            with self._lock:
                self._cancel_requested.add(job.id)
        if committed:  # an earlier run was killed after the commit point, before the job said so
            with self._lock:
                job.add_event("status", "the result was committed by an earlier run of this job")
                if job.status == "queued":
                    job.transition("running")
                self._finish(job, "succeeded")
            self._settle()
            return None
        if max_attempts is not None and lease.attempts > max_attempts:
            with self._lock:
                self._finish(job, "failed", {"type": "interrupted", "message": f"interrupted: the job's runner "
                                             f"stopped {lease.attempts - 1} times (POLYSERVE_JOB_MAX_ATTEMPTS)"})
            self._settle()
            return None
        with self._lock:
            job.add_event("status", f"claimed by {self.replica_id} (attempt {lease.attempts})",
                          attempt=lease.attempts)
            self._queue.append(job.id)
        self._persist(job)
        return Job.from_json(job.to_json())

    def heartbeat(self) -> list[str]:
        """Renew the leases of this runner's jobs; a job whose lease another claimer took over is
        dropped (`lose`). A store that cannot be reached is tried again next beat. Returns the ids
        of the jobs lost."""
        with self._lock:
            leases = [(job_id, hold) for job_id, hold in self._holds.items() if hasattr(hold, "renew")]
        lost = []
        for job_id, hold in leases:
            try:
                kept = hold.renew()
            except Exception as err:  # noqa: BLE001 - the lease lasts; the next beat tries again
                log.warning("lease of job %s not renewed: %s", job_id, type(err).__name__)
                continue
            if not kept:
                self.lose(job_id)
                lost.append(job_id)
        return lost

    def lose(self, job_id: str) -> None:
        """Another claimer runs the job now: stop it at the next slice and write nothing."""
        log.warning("job %s: its lease was taken over by another worker; dropping this run", job_id)
        with self._lock:
            self._lost.add(job_id)

    def give_back(self) -> None:
        """Stopping: every job held by a lease becomes claimable again at once (unwritten)."""
        with self._lock:
            leases = [(job_id, hold) for job_id, hold in self._holds.items() if hasattr(hold, "give_back")]
        for job_id, hold in leases:
            try:
                hold.give_back()
            except Exception as err:  # noqa: BLE001 - then its lease simply expires
                log.warning("job %s not given back: %s", job_id, type(err).__name__)

    def _give_back_one(self, job: Job) -> None:
        """On the I/O thread: a leased job this run cannot go on with, claimable again at once."""
        hold = self._holds.get(job.id)
        self._drop(job)
        try:
            hold.give_back()  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - then its lease simply expires
            log.warning("job %s not given back: %s", job.id, type(err).__name__)

    def _drop(self, job: Job) -> bool:
        """Forget a lost job: no job write, no task write (the claimer that took it over owns both)."""
        with self._lock:
            self._lost.discard(job.id)
            self._jobs.pop(job.id, None)
            self._holds.pop(job.id, None)
            self._cancel_requested.discard(job.id)
            if job.id in self._queue:
                self._queue.remove(job.id)
            if self._current is not None and self._current[0] is job:
                self._current = None
            if self._starting is not None and self._starting[0] is job:
                self._starting = None
        return True

    # -- the slice the engine runs ------------------------------------------------------------
    def _offload(self, fn: Callable[[], None]) -> bool:
        """Hand `fn` (file writes, locks, notifications) to the I/O thread; step() goes on only
        once it is done. Waits for it at most BUILD_WAIT. Returns True (work was done)."""
        self._busy = self._io_pool.submit(fn)
        wait([self._busy], timeout=BUILD_WAIT)
        return True

    def _write_later(self, job: Job) -> None:
        """The job's state, written by the I/O thread (in order with the other hand-offs)."""
        self._io_pool.submit(_logged, self._persist, job)

    def _finish_later(self, job: Job, status: str, error: dict[str, str] | None = None) -> bool:
        def finish() -> None:
            with self._lock:
                self._finish(job, status, error)
            self._settle()

        return self._offload(finish)

    def check_cancels(self) -> int:
        """Read the store's cancel markers of this runner's unfinished jobs (left by a cancel or a
        delete through another replica) into memory, where step() looks. Returns how many are
        newly seen. Runs on the poll thread; a store that cannot be read is tried again next poll."""
        with self._lock:
            ids = [job_id for job_id, job in self._jobs.items()
                   if not job.finished and job_id not in self._cancel_requested]
        seen = 0
        for job_id in ids:
            try:
                marked = self.store.cancel_requested(job_id)
            except Exception as err:  # noqa: BLE001 - a store outage delays a cancel, nothing more
                log.warning("cancel markers not read: %s", type(err).__name__)
                return seen
            if marked:
                with self._lock:
                    self._cancel_requested.add(job_id)
                seen += 1
        return seen

    def _start_poller(self) -> None:
        with self._lock:
            if self._poller is not None:
                return
            self._poller = threading.Thread(target=self._poll_loop, name="polyserve-job-cancels", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        openmp.one_thread()
        while True:
            time.sleep(self.cancel_poll_seconds)
            with self._lock:
                idle = all(job.finished for job in self._jobs.values())
            if not idle:
                self.check_cancels()

    def _cancelled_elsewhere(self, job: Job) -> bool:
        with self._lock:
            return job.id in self._cancel_requested

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every hand-off so far is done (tests, shutdown)."""
        self._io_pool.submit(lambda: None).result(timeout)

    def step(self) -> bool:
        """Run one slice of the current job (starting the next queued one if needed).
        Returns True if any work was done (or a job is being prepared)."""
        if self._busy is not None:  # a commit or the end of a job is being written
            wait([self._busy], timeout=BUILD_WAIT)
            if not self._busy.done():
                return True
            if self._busy.exception() is not None:
                log.error("a job's writes failed", exc_info=self._busy.exception())
            self._busy = None
        with self._lock:
            if self._current is None and self._starting is None:
                if not self._queue:
                    return False
                job = self._jobs[self._queue.popleft()]
                # counted by `pending` from the moment it leaves the queue: a POST between this and
                # the builder's start must not see a free place in the queue limit
                self._starting = (job, None)
                start = True
            elif self._current is None:
                job, pending_future = self._starting  # type: ignore[misc]
                assert pending_future is not None  # set in the same step() that took the job
                future = pending_future
                start = False
            else:
                job, adaptation = self._current
                start = False
            lost = job.id in self._lost
            running = self._current is not None
        if lost:
            if running:
                adaptation.cancel()
            return self._drop(job)
        if start and self._cancelled_elsewhere(job):  # cancelled here, or through another replica
            with self._lock:
                self._starting = None
            return self._finish_later(job, "cancelled")
        if start:  # reading examples, tokenising, loading candidates: off the engine thread
            future = self._builder.submit(self._build, job)
            with self._lock:
                self._starting = (job, future)
        if self._current is None:
            wait([future], timeout=BUILD_WAIT)  # a bounded slice: the engine keeps serving meanwhile
            if not future.done():
                return True
            with self._lock:
                self._starting = None
            try:
                adaptation = future.result()
            except StoreUnavailable as err:
                if hasattr(self._holds.get(job.id), "give_back"):  # a leased job: another claim runs it
                    log.warning("job %s not started, the store is away (%s); given back", job.id, err)
                    return self._offload(lambda: self._give_back_one(job))
                log.exception("job %s failed to start", job.id)
                return self._finish_later(job, "failed", public_error("adaptation_error", err))
            except Exception as err:
                log.exception("job %s failed to start", job.id)
                return self._finish_later(job, "failed", public_error("adaptation_error", err))
            with self._lock:
                job.transition("running")
                self._current = (job, adaptation)
            self._write_later(job)
        if self._cancelled_elsewhere(job):
            adaptation.cancel()
            with self._lock:
                self._current = None
            return self._finish_later(job, "cancelled")
        try:
            more = adaptation.step()
            if not more:
                result = adaptation.result()
        except Exception as err:
            log.exception("job %s failed", job.id)
            with self._lock:
                self._current = None
            return self._finish_later(job, "failed", public_error("adaptation_error", err))
        if not more:
            return self._offload(lambda: self._commit(job, result))
        return True

    def _build(self, job: Job) -> AdaptationLike:
        """On the builder thread: the job's examples and its adaptation (tokenised, ready)."""
        examples = self.store.get_job_examples(job.id)
        return self.make_adaptation(job, examples, lambda p: self._progress(job, p))

    def _progress(self, job: Job, info: dict[str, Any]) -> None:
        with self._lock:
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
            self._write_later(job)

    def _commit(self, job: Job, result: Any) -> None:
        """Write the learned weights (the task's commit point), then mark the job succeeded; under
        the store's task lock, and only while the task is still this job's placeholder (a delete
        through any replica meanwhile wins: the result is discarded, the task stays deleted).
        A queued job's run whose lease another claimer took over writes nothing; a run that finds
        the result committed by an earlier run of the job marks it succeeded and writes no task."""
        with self.store.task_lock(job.task):
            hold = self._holds.get(job.id)
            if hold is not None and not hold.still_held():
                self._drop(job)
                log.warning("job %s: lease lost before the commit; result discarded (another run commits)", job.id)
                return
            if self._committed(job):
                with self._lock:
                    job.add_event("status", "the result was committed by an earlier run of this job")
                    self._current = None
                    self._finish(job, "succeeded")
            elif not self._still_ours(job):
                log.warning("job %s: task %r was deleted or replaced while training; result discarded",
                            job.id, job.task)
                with self._lock:
                    job.add_event("status", "the task was deleted while the job ran; result discarded")
                    self._current = None
                    self._finish(job, "cancelled")
            else:
                self._write_result(job, result)
        self._settle()

    def commit_early(self, job: Job, result: Any) -> None:
        """serve_early: the retrieved routing becomes the task's first version, servable at once,
        while training goes on (called from the job's slice, on the engine thread: the commit
        itself is written by the I/O thread, before the job's final commit)."""
        self._io_pool.submit(_logged, self._commit_early, job, result)

    def _commit_early(self, job: Job, result: Any) -> None:
        with self.store.task_lock(job.task):
            if not self._still_ours(job):
                return  # deleted or cancelled meanwhile: the final commit discards the rest
            source = {"job_id": job.id, "n_examples": job.n_examples, "method": job.method, "stage": "early"}
            record = self.store.put_routing(job.task, result.tensors["logits"], method=job.method, source=source,
                                            metrics=dict(result.metrics), job_id=job.id)
        with self._lock:
            job.live_version = record.version
            job.add_event("status", f"serving the retrieved routing as version {record.version} while training "
                          "goes on", version=record.version)
        self._persist(job)
        self.on_task_changed(job.task)

    def _committed(self, job: Job) -> bool:
        """The task's record says this job's final result is in (the commit point is the record
        write; a serve_early job's first, retrieved version is not its result)."""
        try:
            record = self.store.get_task(job.task)
        except TaskNotFound:
            return False
        return record.job_id == job.id and record.status == "ready" and record.source.get("stage") != "early"

    def _still_ours(self, job: Job) -> bool:
        """The task is still this job's: its placeholder, or (serve_early) its early version."""
        try:
            record = self.store.get_task(job.task)
        except TaskNotFound:
            return False
        if record.job_id != job.id or self.store.cancel_requested(job.id):
            return False
        return record.status == "training" or (record.status == "ready" and record.source.get("stage") == "early")

    def _write_result(self, job: Job, result: Any) -> None:
        try:
            metrics = dict(getattr(result, "metrics", {}) or {})
            source = {"job_id": job.id, "n_examples": job.n_examples, "method": job.method}
            if result.kind == "routing":
                record = self.store.put_routing(job.task, result.tensors["logits"], method=job.method,
                                                source=source, metrics=metrics, job_id=job.id)
            else:
                record = self.store.put_lora(job.task, result.tensors, method=job.method,
                                             source=source, metrics=metrics, job_id=job.id)
        except StoreUnavailable:
            raise  # the database is away: the slice retries the commit (the lease outlives a short outage)
        except Exception as err:
            log.exception("job %s could not store its result", job.id)
            with self._lock:
                self._current = None
                self._finish(job, "failed", error=public_error("store_error", err))
            return
        with self._lock:
            job.metrics.update({k: v for k, v in metrics.items()
                                if isinstance(v, int | float | str) and not isinstance(v, bool)})
            job.live_version = record.version
            self._current = None
            self._finish(job, "succeeded")

    def _finish(self, job: Job, status: str, error: dict[str, str] | None = None) -> None:
        """Terminal transition, in memory (the caller holds `_lock`); the caller then calls
        `_settle()` without the lock to persist, release and notify. The registry entry is fixed
        first, here: once a client can read the terminal status, a cancelled job's placeholder
        task is already gone (it read "cancelled" and still found the task before)."""
        if status != "succeeded":
            _mark_task_not_ready(self.store, job, status, error)
        job.transition(status, error=error)  # type: ignore[arg-type]
        self._cancel_requested.discard(job.id)
        self._done.append((job, status, error))

    def _settle(self) -> None:
        """The I/O of finished jobs (call without `_lock`): job file, registry entry, lock file,
        then the notifications (Redis publish) and metrics."""
        with self._lock:
            done, self._done = self._done, []
        for job, status, error in done:
            self._persist(job)
            self._release_lock(job.id)
            self.on_task_changed(job.task)
            self.on_job_finished(job)

    # -- start-up -----------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Every unfinished job whose owner process is gone: succeeded if its result was committed
        (the task record names it), else failed ("interrupted"). Returns their ids."""
        recovered = []
        for data in self.store.list_jobs():
            try:
                job = Job.from_json(data)
            except (TypeError, ValueError):  # a record this version cannot read: never stop a start-up
                log.warning("job record %r skipped: unreadable", data.get("id"))
                continue
            if job.finished or job.id in self._jobs:
                continue
            if self.store.job_enqueued(job.id):
                continue  # the fleet's workers own it: its lease says whether its runner lives
            hold = self.store.hold_job(job.id)  # a live owner would hold it
            if hold is None:
                continue  # another live replica runs it
            try:
                job = Job.from_json(self.store.get_job(job.id))  # it may have finished meanwhile
                if job.finished:
                    continue
                if self._committed(job):  # killed after the commit point, before the job said so
                    job.transition("succeeded")
                    job.add_event("status", "recovered: the result was committed before the server stopped")
                    self._persist(job)
                else:
                    reason = "before the job ran" if job.status == "queued" else "while the job was running"
                    job.transition("failed", error={"type": "interrupted",
                                                    "message": f"interrupted: the server stopped {reason}"})
                    self._persist(job)
                    _mark_task_not_ready(self.store, job, "failed", job.error)
            finally:
                hold.release()
            recovered.append(job.id)
            self.on_task_changed(job.task)
        return recovered


def _logged(fn: Callable[..., None], *args: Any) -> None:
    """An I/O hand-off nobody waits for: its failure is logged (the job's own state says the rest)."""
    try:
        fn(*args)
    except Exception:
        log.exception("a job's background write failed")


def _mark_task_not_ready(store: AdapterStore, job: Job, status: str, error: dict[str, str] | None) -> None:
    """A cancelled job removes its placeholder task; a failed one leaves it "failed" with the error.
    A task that is ready stays (a serve_early job's retrieved version keeps being served)."""
    message = None if status == "cancelled" else (error or {}).get("message") or status
    store.settle_placeholder(job.task, job.id, error=message)
