"""The worker: what registration trains on (no generation engine), a claim loop and a heartbeat.

    build_worker(settings)   backbone -> store (the default inventory installed once into an empty
                             one) -> routed model with the inventory's skills -> JobRunner
    claim loop (a thread)    idle: AdapterStore.claim_job every POLYSERVE_JOB_POLL_SECONDS; holding a
                             job: JobRunner.step() back to back (no engine to share the model with)
    heartbeat (a thread)     every lease / 3: JobRunner.heartbeat() renews the job's lease; a lease
                             another worker took over drops this run, unwritten
    stop()                   the job in hand is given back (claimable again at once)

Cancels and deletes made through any replica reach the job through the store's cancel markers,
read by the runner's poll thread; progress and events are written to the job's record.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from dataclasses import dataclass

from adapters_store.backbone.load import Backbone, load_backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.store import open_store
from adapters_store.store.contract import AdapterStore
from adapters_store.store.errors import StoreError
from server.fleet.worker.metrics import WorkerMetrics
from server.infra import cpus
from server.jobs.adaptation import TrainingModel, make_adaptation
from server.jobs.model import Job
from server.jobs.runner import JobRunner
from server.wiring.settings import Settings

log = logging.getLogger("polyserve.worker")


def worker_id() -> str:
    return f"worker-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


@dataclass
class Worker:
    settings: Settings
    backbone: Backbone
    store: AdapterStore
    model: TrainingModel
    metrics: WorkerMetrics
    id: str

    def __post_init__(self) -> None:
        self.runner = JobRunner(self.store, self._make_adaptation, replica_id=self.id,
                                on_job_finished=self._finished)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _make_adaptation(self, job: Job, examples, progress):
        return make_adaptation(self.model, job, examples, progress, lambda res: self.runner.commit_early(job, res))

    def _finished(self, job: Job) -> None:
        self.metrics.jobs.labels(status=job.status).inc()
        if job.status == "succeeded" and job.started_at and job.finished_at:
            self.metrics.adaptation_seconds.observe(job.finished_at - job.started_at)
        log.info("job %s of task %r %s", job.id, job.task, job.status)

    # -- threads ----------------------------------------------------------------------------
    def start(self) -> None:
        for target, name in ((self._claim_loop, "polyserve-worker-claims"), (self._beat, "polyserve-worker-lease")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("%s claiming jobs from %s (lease %.1f s)", self.id, self.store.location,
                 self.settings.job_lease_seconds)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self.runner.give_back()
        try:
            self.runner.flush(timeout=10)
        except Exception:  # noqa: BLE001 - stopping: what is unwritten is run again elsewhere
            log.warning("job writes not flushed at stop")

    def _claim_loop(self) -> None:
        settings = self.settings
        while not self._stop.is_set():
            try:
                if self.runner.pending == 0:
                    self.metrics.running.set(0)
                    lease = self.store.claim_job(self.id, settings.job_lease_seconds)
                    if lease is None:
                        self._stop.wait(settings.job_poll_seconds)
                        continue
                    self.metrics.claims.inc()
                    log.info("claimed job %s (attempt %d)", lease.job_id, lease.attempts)
                    self.runner.adopt(lease, max_attempts=settings.job_max_attempts)
                    self.metrics.running.set(self.runner.pending)
                    continue
                if not self.runner.step():
                    self._stop.wait(0.01)
            except Exception as err:  # noqa: BLE001 - a store outage: the lease outlives a short one
                self.metrics.store_errors.inc()
                log.warning("claim loop: %s: %s; retrying", type(err).__name__, err)
                self._stop.wait(1.0)

    def _beat(self) -> None:
        every = self.settings.job_lease_seconds / 3
        while not self._stop.wait(every):
            for _job_id in self.runner.heartbeat():
                self.metrics.leases_lost.inc()


def build_worker(settings: Settings, metrics: WorkerMetrics) -> Worker:
    """Blocking: loads the backbone copy registration trains on and the store's inventory."""
    import torch

    from server.engines.dtype import backbone_dtype, dtype_name
    from server.wiring.runtime import _maybe_install_default_inventory
    from training.precision import resolve_autocast

    # POLYSERVE_THREADS, else one per CPU this process may use (server/infra/cpus.py)
    torch.set_num_threads(cpus.default_threads(settings.threads))
    bb = load_backbone(settings.backbone, device=settings.device,
                       dtype=dtype_name(backbone_dtype(settings.device, settings.dtype)))
    store = open_store(settings.store_location, cache_dir=settings.home.expanduser() / "inventories")
    _maybe_install_default_inventory(store, settings.backbone, settings.shipped_below_floor)
    if not store.has_inventory():
        raise StoreError(f"no skill inventory in {store.location}: a worker has nothing to register tasks against")
    info, skills = store.load_inventory(expected_fingerprint=bb.fingerprint)
    routed = RoutedModel(bb.model, info.spec)
    if tuple(routed.names) != tuple(info.layer_names):
        raise StoreError("the inventory's layer order does not match the backbone's target linears")
    routed.load_skills({k: v.to(bb.device) for k, v in skills.items()})
    model = TrainingModel(routed, info, {k: v.to(device=bb.device, dtype=torch.float32) for k, v in skills.items()},
                          bb.tokenizer, store, settings.demonstration_budget)
    bf16 = resolve_autocast("auto", bb.device)  # decided once, before any job (as the server does)
    log.info("registration training: %s", "bf16 autocast" if bf16 else "float32")
    return Worker(settings, bb, store, model, metrics, worker_id())
