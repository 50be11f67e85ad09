"""The job runner's claims on its jobs: the local hold of a job run here, a worker's lease.

The process running a job holds the store's claim on it (`AdapterStore.hold_job`: an fcntl lock
in a directory store, an advisory lock on its own connection in PostgreSQL; both end with the
process), so server/jobs/recovery.py can tell a job whose process died. A fleet's worker takes
claimed jobs with `JobRunner.adopt(lease)` (server/jobs/runner.py): the lease is the job's hold,
renewed by `heartbeat()`. A job whose lease another worker took over is dropped without a write
(`lose`: its run stops at the next slice), and the journal (server/jobs/journal.py) writes a
leased job only while its lease is still its own.

Threads: `hold` runs on submit's caller, `release` wherever a job is settled (the I/O thread for
the jobs the slices end), `heartbeat` on the worker's lease thread (server/fleet/worker/loop.py),
`give_back` on the worker's way out, `give_back_one` on the I/O thread. The holds live in the
runner's memory (server/jobs/state.py); no store call is made under its lock.
"""

from __future__ import annotations

import logging

from adapters_store.store.contract import AdapterStore
from server.jobs.model import Job
from server.jobs.state import RunnerState

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, store: AdapterStore, state: RunnerState) -> None:
        self.store = store
        self.state = state

    def hold(self, job_id: str) -> None:
        """Claim a job submitted here (a new id: nobody else can hold it)."""
        hold = self.store.hold_job(job_id)
        if hold is None:
            raise RuntimeError(f"job {job_id} is already claimed by another process")
        self.state.holds[job_id] = hold

    def release(self, job_id: str) -> None:
        hold = self.state.holds.pop(job_id, None)
        if hold is not None:
            hold.release()

    def leased(self, job_id: str) -> bool:
        """The job is held by a lease from the store's queue (another claim can run it)."""
        return hasattr(self.state.holds.get(job_id), "give_back")

    def heartbeat(self) -> list[str]:
        """Renew the leases of this runner's jobs; a job whose lease another claimer took over is
        dropped (`lose`). A store that cannot be reached is tried again next beat. Returns the ids
        of the jobs lost."""
        with self.state.lock:
            leases = [(job_id, hold) for job_id, hold in self.state.holds.items() if hasattr(hold, "renew")]
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
        with self.state.lock:
            self.state.lost.add(job_id)

    def give_back(self) -> None:
        """Stopping: every job held by a lease becomes claimable again at once (unwritten)."""
        with self.state.lock:
            leases = [(job_id, hold) for job_id, hold in self.state.holds.items() if hasattr(hold, "give_back")]
        for job_id, hold in leases:
            try:
                hold.give_back()
            except Exception as err:  # noqa: BLE001 - then its lease simply expires
                log.warning("job %s not given back: %s", job_id, type(err).__name__)

    def give_back_one(self, job: Job) -> None:
        """On the I/O thread: a leased job this run cannot go on with, claimable again at once."""
        hold = self.state.holds.get(job.id)
        self.state.drop(job)
        try:
            hold.give_back()  # type: ignore[union-attr]
        except Exception as err:  # noqa: BLE001 - then its lease simply expires
            log.warning("job %s not given back: %s", job.id, type(err).__name__)
