"""The job runner's cancel poll: another replica's cancel markers, read into memory.

A cancel or a delete through another replica leaves a marker in the store
(`AdapterStore.request_cancel`). The engine thread's `JobRunner.step()` (server/jobs/runner.py)
never reads the store, so this poll thread ("polyserve-job-cancels", a daemon, started with the
runner's first job) reads the markers of the runner's unfinished jobs every `period` seconds into
the runner's memory (server/jobs/state.py), where the next slice looks.
"""

from __future__ import annotations

import logging
import threading
import time

from adapters_store.store.contract import AdapterStore
from server.infra import openmp
from server.jobs.state import RunnerState

log = logging.getLogger(__name__)


class CancelPoll:
    def __init__(self, store: AdapterStore, state: RunnerState, period: float) -> None:
        self.store = store
        self.state = state
        self.period = period
        self.thread: threading.Thread | None = None

    def check(self) -> int:
        """Read the store's cancel markers of this runner's unfinished jobs (left by a cancel or a
        delete through another replica) into memory, where step() looks. Returns how many are
        newly seen. Runs on the poll thread; a store that cannot be read is tried again next poll."""
        state = self.state
        with state.lock:
            ids = [job_id for job_id, job in state.jobs.items()
                   if not job.finished and job_id not in state.cancel_requested]
        seen = 0
        for job_id in ids:
            try:
                marked = self.store.cancel_requested(job_id)
            except Exception as err:  # noqa: BLE001 - a store outage delays a cancel, nothing more
                log.warning("cancel markers not read: %s", type(err).__name__)
                return seen
            if marked:
                with state.lock:
                    state.cancel_requested.add(job_id)
                seen += 1
        return seen

    def start(self) -> None:
        """Start the poll thread, once."""
        with self.state.lock:
            if self.thread is not None:
                return
            self.thread = threading.Thread(target=self._loop, name="polyserve-job-cancels", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        openmp.one_thread()
        while True:
            time.sleep(self.period)
            with self.state.lock:
                idle = all(job.finished for job in self.state.jobs.values())
            if not idle:
                self.check()
