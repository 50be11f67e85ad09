"""A worker's Prometheus metrics (own CollectorRegistry; prefix polyserve_, base units)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` series, as the server's (server.infra.metrics)

P = "polyserve_"


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.jobs = Counter(P + "jobs", "Adaptation jobs by final status.", ["status"], registry=r)
        self.adaptation_seconds = Histogram(P + "adaptation_seconds", "Wall time of successful adaptation jobs.",
                                            buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
                                            registry=r)
        self.claims = Counter(P + "job_claims", "Jobs this worker claimed from the queue.", registry=r)
        self.leases_lost = Counter(P + "job_leases_lost", "Claims another worker took over after the lease "
                                   "expired (this run was dropped unwritten).", registry=r)
        self.running = Gauge(P + "worker_jobs_running", "Jobs this worker holds (0 or 1).", registry=r)
        self.store_errors = Counter(P + "worker_store_errors", "Claim-loop rounds that failed on the store.",
                                    registry=r)
        for status in ("succeeded", "failed", "cancelled"):
            self.jobs.labels(status=status)

    def render(self) -> bytes:
        return generate_latest(self.registry)
