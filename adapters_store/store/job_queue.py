"""The job queue of a fleet: jobs a replica enqueued (POLYSERVE_JOBS=off) for workers to claim.

The semantics, written once over each backend's four primitives (adapters_store.store.contract):

    enqueue(job)                      the job becomes claimable (after its record, examples and
                                      placeholder task are written: a worker finds them all)
    claim(owner, lease) -> JobLease   the oldest job whose lease is free or expired gets a new
                                      token, owner and lease_until = now + lease, attempts + 1
                                      (PostgreSQL: UPDATE ... FROM (SELECT ... FOR UPDATE SKIP
                                      LOCKED LIMIT 1); directory: under the store-wide lock)
    lease.renew()  -> bool            heartbeat: lease_until = now + lease while the token is
                                      still this claim's; False once another claimer took it
    lease.still_held() -> bool        the token is still this claim's (checked by the commit,
                                      under the task's lock)
    lease.release()                   the job is finished: its queue entry goes (token checked)
    lease.give_back()                 a worker stopping mid-job: claimable again at once

Delivery is at least once: a claimer that dies (or stops heart-beating) loses its lease when it
expires, and the next claim runs the job again. The result is committed once: the commit checks,
under the task's lock, that the claim is still held and that no earlier run committed the result
(server/jobs/journal.py `Journal.commit`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Protocol


class LeaseQueue(Protocol):
    """The queue primitives a lease calls back into: every store backend has them
    (adapters_store.store.contract declares them; the lease needs no more of the store)."""

    def _queue_renew(self, job_id: str, token: str, lease_seconds: float) -> bool: ...

    def _queue_holds(self, job_id: str, token: str) -> bool: ...

    def _queue_remove(self, job_id: str, token: str | None) -> None: ...


def new_token() -> str:
    return secrets.token_hex(8)


@dataclass
class JobLease:
    """One claim on a queued job (a JobHold: the runner releases it when the job ends)."""

    store: LeaseQueue
    job_id: str
    token: str
    owner: str
    lease_seconds: float
    attempts: int

    def renew(self) -> bool:
        return self.store._queue_renew(self.job_id, self.token, self.lease_seconds)

    def still_held(self) -> bool:
        return self.store._queue_holds(self.job_id, self.token)

    def release(self) -> None:
        self.store._queue_remove(self.job_id, self.token)

    def give_back(self) -> None:
        self.store._queue_renew(self.job_id, self.token, 0.0)
