"""The job runner's memory, shared by its parts under one lock.

server/jobs/runner.py (the slices, on the engine thread, and the submit / cancel / adopt entry
points, on the caller's), server/jobs/journal.py (the I/O thread), server/jobs/leases.py (the
worker's lease beat) and server/jobs/cancels.py (the cancel-poll thread) all read and change the
same jobs; `lock` guards them. It guards memory only: a GET of a job must not wait on an fsync,
so nothing here writes a file, takes a store lock or talks to Redis.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future

from adapters_store.store.contract import JobHold
from server.jobs.contract import AdaptationLike
from server.jobs.model import Job


class RunnerState:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # in-memory state only: no file or Redis I/O under it
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.holds: dict[str, JobHold] = {}  # a job's claim: a local hold, or a worker's JobLease
        self.lost: set[str] = set()  # jobs whose lease another claimer took over: dropped unwritten
        self.cancel_requested: set[str] = set()
        self.current: tuple[Job, AdaptationLike] | None = None
        # being built on the builder thread (the future is None only inside the step() that took it)
        self.starting: tuple[Job, Future[AdaptationLike] | None] | None = None

    def drop(self, job: Job) -> bool:
        """Forget a lost job: no job write, no task write (the claimer that took it over owns both).
        Returns True (a slice that drops a job did work)."""
        with self.lock:
            self.lost.discard(job.id)
            self.jobs.pop(job.id, None)
            self.holds.pop(job.id, None)
            self.cancel_requested.discard(job.id)
            if job.id in self.queue:
                self.queue.remove(job.id)
            if self.current is not None and self.current[0] is job:
                self.current = None
            if self.starting is not None and self.starting[0] is job:
                self.starting = None
        return True
