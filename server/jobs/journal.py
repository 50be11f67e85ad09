"""The job runner's writes: job records, progress, transitions, the commit, the end of a job.

The job record (store/jobs/<id>.json) is rewritten atomically on every transition and at most
every `persist_every` seconds while running (the runner, server/jobs/runner.py, says when); the
task's registry entry says "training" until the weights are committed.

The engine thread never writes a file, takes a store lock or talks to Redis: `JobRunner.step()`
hands every job write (progress, transitions, the commit under the task's lock, the end of a job
and its notifications) to this journal's one I/O thread ("polyserve-job-io"), in order. While
such a hand-off is unfinished, `busy()` waits for it at most the slice's bound and otherwise says
so, so a store lock held elsewhere or a slow disk delays the job, never decoding. The entry points
that are not the engine's (submit, cancel, adopt: an HTTP handler's or a worker's thread) write
through the same `persist` / `finish` / `settle` on their own thread.

The commit (`commit`, on the I/O thread) checks under the task's lock that the task is still the
job's placeholder (a delete through any replica meanwhile wins), that a leased job's lease is
still held (server/jobs/leases.py) and that no earlier run of the job committed its result: a job
that runs twice is committed once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import StoreUnavailable, TaskNotFound
from server.infra import openmp
from server.jobs.contract import AdaptationResult
from server.jobs.leases import LeaseKeeper
from server.jobs.model import Job, JobStatus
from server.jobs.public_errors import public_error
from server.jobs.state import RunnerState

log = logging.getLogger(__name__)


class Journal:
    def __init__(
        self,
        store: AdapterStore,
        state: RunnerState,
        leases: LeaseKeeper,
        *,
        on_task_changed: Callable[[str], None],
        on_job_finished: Callable[[Job], None],
        slice_wait: float,
    ) -> None:
        self.store = store
        self.state = state
        self.leases = leases
        self.on_task_changed = on_task_changed
        self.on_job_finished = on_job_finished
        self.slice_wait = slice_wait  # how long a slice waits for a hand-off (server/jobs/runner.py)
        # under the state's lock (memory only)
        self._io: dict[str, threading.Lock] = {}  # per job: its file writes in order
        self._done: list[tuple[Job, JobStatus, dict[str, str] | None]] = []  # finished, not yet settled
        # job writes handed off by the engine thread (step), one at a time, in order
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="polyserve-job-io",
                                        initializer=openmp.one_thread)
        self._busy: Future[None] | None = None  # the last hand-off step() must see done before going on

    # -- writing a job's state --------------------------------------------------------------------
    def persist(self, job: Job) -> None:
        """Write the job's latest state. Never called under the state's lock: the lock only guards
        memory (a GET of a job must not wait on an fsync); a per-job I/O lock keeps one job's writes
        in order (the snapshot is taken under it, so a later write always carries a later state).
        A leased job's run writes only while its lease is still its own (the check and the write
        are one step of the store): once another worker took the job over, this run's stale state
        must not overwrite that worker's."""
        with self.state.lock:
            io = self._io.setdefault(job.id, threading.Lock())
            hold = self.state.holds.get(job.id)
        with io:
            with self.state.lock:
                data = job.to_json()
            token = getattr(hold, "token", None)  # a JobLease's; a local job's hold has none
            if token is None:
                self.store.put_job(data)
            elif not self.store.put_job_if_held(data, token):
                self.leases.lose(job.id)

    def forget(self, job_id: str) -> None:
        """A job that leaves memory takes its write lock along (the caller holds the state's lock)."""
        self._io.pop(job_id, None)

    # -- hand-offs from the engine thread -----------------------------------------------------------
    def busy(self) -> bool:
        """step()'s first look: is the last hand-off still being written? Waits for it at most
        `slice_wait`; a hand-off that failed is logged, and then forgotten."""
        if self._busy is None:
            return False
        wait([self._busy], timeout=self.slice_wait)
        if not self._busy.done():
            return True
        if self._busy.exception() is not None:
            log.error("a job's writes failed", exc_info=self._busy.exception())
        self._busy = None
        return False

    def offload(self, fn: Callable[[], None]) -> bool:
        """Hand `fn` (file writes, locks, notifications) to the I/O thread; step() goes on only
        once it is done. Waits for it at most `slice_wait`. Returns True (work was done)."""
        self._busy = self._pool.submit(fn)
        wait([self._busy], timeout=self.slice_wait)
        return True

    def write_later(self, job: Job) -> None:
        """The job's state, written by the I/O thread (in order with the other hand-offs)."""
        self._pool.submit(_logged, self.persist, job)

    def finish_later(self, job: Job, status: JobStatus, error: dict[str, str] | None = None) -> bool:
        """`finish` and `settle` on the I/O thread, handed off like a commit. Returns True."""
        def finish() -> None:
            with self.state.lock:
                self.finish(job, status, error)
            self.settle()

        return self.offload(finish)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every hand-off so far is done (tests, shutdown)."""
        self._pool.submit(lambda: None).result(timeout)

    # -- the commit ---------------------------------------------------------------------------------
    def commit(self, job: Job, result: AdaptationResult) -> None:
        """Write the learned weights (the task's commit point), then mark the job succeeded; under
        the store's task lock, and only while the task is still this job's placeholder (a delete
        through any replica meanwhile wins: the result is discarded, the task stays deleted).
        A queued job's run whose lease another claimer took over writes nothing; a run that finds
        the result committed by an earlier run of the job marks it succeeded and writes no task."""
        with self.store.task_lock(job.task):
            hold = self.state.holds.get(job.id)
            if hold is not None and not hold.still_held():
                self.state.drop(job)
                log.warning("job %s: lease lost before the commit; result discarded (another run commits)", job.id)
                return
            if committed(self.store, job):
                with self.state.lock:
                    job.add_event("status", "the result was committed by an earlier run of this job")
                    self.state.current = None
                    self.finish(job, "succeeded")
            elif not still_ours(self.store, job):
                log.warning("job %s: task %r was deleted or replaced while training; result discarded",
                            job.id, job.task)
                with self.state.lock:
                    job.add_event("status", "the task was deleted while the job ran; result discarded")
                    self.state.current = None
                    self.finish(job, "cancelled")
            else:
                self._write_result(job, result)
        self.settle()

    def commit_early(self, job: Job, result: AdaptationResult) -> None:
        """serve_early: the retrieved routing (auto: the demonstrations) becomes the task's first
        version, servable at once, while training goes on (called from the job's slice, on the
        engine thread: the commit itself is written by the I/O thread, before the job's final
        commit)."""
        self._pool.submit(_logged, self._commit_early, job, result)

    def _commit_early(self, job: Job, result: AdaptationResult) -> None:
        with self.store.task_lock(job.task):
            if not still_ours(self.store, job):
                return  # deleted or cancelled meanwhile: the final commit discards the rest
            source = {"job_id": job.id, "n_examples": job.n_examples, "method": job.method, "stage": "early"}
            if result.kind == "demos":  # auto: its demonstrations, while it weighs the forms
                demonstrations = list(getattr(result, "demonstrations", None) or [])
                record = self.store.put_demonstrations(job.task, demonstrations, method=job.method, source=source,
                                                       metrics=dict(result.metrics), job_id=job.id)
            else:
                record = self.store.put_routing(job.task, result.tensors["logits"], method=job.method,
                                                source=source, metrics=dict(result.metrics), job_id=job.id)
        what = "demonstrations" if result.kind == "demos" else "retrieved routing"
        with self.state.lock:
            job.live_version = record.version
            job.add_event("status", f"serving the {what} as version {record.version} while training "
                          "goes on", version=record.version)
        self.persist(job)
        self.on_task_changed(job.task)

    def _write_result(self, job: Job, result: AdaptationResult) -> None:
        try:
            metrics = dict(getattr(result, "metrics", {}) or {})
            source = {"job_id": job.id, "n_examples": job.n_examples, "method": job.method}
            demonstrations = list(getattr(result, "demonstrations", None) or [])
            if result.kind == "demos":
                record = self.store.put_demonstrations(job.task, demonstrations, method=job.method,
                                                       source=source, metrics=metrics, job_id=job.id)
            elif result.kind == "routing":
                record = self.store.put_routing(job.task, result.tensors["logits"], method=job.method,
                                                source=source, metrics=metrics, job_id=job.id,
                                                demonstrations=demonstrations)
            else:
                record = self.store.put_lora(job.task, result.tensors, method=job.method,
                                             source=source, metrics=metrics, job_id=job.id,
                                             demonstrations=demonstrations)
        except StoreUnavailable:
            raise  # the database is away: the slice retries the commit (the lease outlives a short outage)
        except Exception as err:
            log.exception("job %s could not store its result", job.id)
            with self.state.lock:
                self.state.current = None
                self.finish(job, "failed", error=public_error("store_error", err))
            return
        with self.state.lock:
            job.metrics.update({k: v for k, v in metrics.items()
                                if (isinstance(v, int | float | str) and not isinstance(v, bool))
                                or k == "estimate"})  # auto's per-form estimate (training.auto), a dict
            job.live_version = record.version
            self.state.current = None
            self.finish(job, "succeeded")

    # -- the end of a job ---------------------------------------------------------------------------
    def finish(self, job: Job, status: JobStatus, error: dict[str, str] | None = None) -> None:
        """Terminal transition, in memory (the caller holds the state's lock); the caller then calls
        `settle()` without the lock to persist, release and notify. The registry entry is fixed
        first, here: once a client can read the terminal status, a cancelled job's placeholder
        task is already gone (it read "cancelled" and still found the task before)."""
        if status != "succeeded":
            mark_task_not_ready(self.store, job, status, error)
        job.transition(status, error=error)
        self.state.cancel_requested.discard(job.id)
        self._done.append((job, status, error))

    def settle(self) -> None:
        """The I/O of finished jobs (call without the state's lock): job file, registry entry, lock
        file, then the notifications (Redis publish) and metrics."""
        with self.state.lock:
            done, self._done = self._done, []
        for job, _status, _error in done:
            self.persist(job)
            self.leases.release(job.id)
            self.on_task_changed(job.task)
            self.on_job_finished(job)


def committed(store: AdapterStore, job: Job) -> bool:
    """The task's record says this job's final result is in (the commit point is the record
    write; a serve_early job's first, retrieved version is not its result)."""
    try:
        record = store.get_task(job.task)
    except TaskNotFound:
        return False
    return record.job_id == job.id and record.status == "ready" and record.source.get("stage") != "early"


def still_ours(store: AdapterStore, job: Job) -> bool:
    """The task is still this job's: its placeholder, or (serve_early) its early version."""
    try:
        record = store.get_task(job.task)
    except TaskNotFound:
        return False
    if record.job_id != job.id or store.cancel_requested(job.id):
        return False
    return record.status == "training" or (record.status == "ready" and record.source.get("stage") == "early")


def mark_task_not_ready(store: AdapterStore, job: Job, status: str, error: dict[str, str] | None) -> None:
    """A cancelled job removes its placeholder task; a failed one leaves it "failed" with the error.
    A task that is ready stays (a serve_early job's retrieved version keeps being served)."""
    message = None if status == "cancelled" else (error or {}).get("message") or status
    store.settle_placeholder(job.task, job.id, error=message)


def _logged(fn: Callable[..., None], *args: Any) -> None:
    """An I/O hand-off nobody waits for: its failure is logged (the job's own state says the rest)."""
    try:
        fn(*args)
    except Exception:
        log.exception("a job's background write failed")
