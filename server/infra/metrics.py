"""Prometheus metrics of one app (own CollectorRegistry): exactly the contract's list.

Base units, counters end in _total, never a task-id label. Histogram buckets span 1 ms .. 60 s
so that both a CPU and a GPU deployment land inside them. No `_created` series: a creation
timestamp per labelled child doubles the series a scrape reads and no dashboard uses them.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # process-wide in prometheus_client: every registry of this process

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
P = "polyserve_"


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "HTTP requests by endpoint template and status code.",
                                ["endpoint", "status", "tenant"], registry=r)
        # endpoint: the route template (as on requests_total), "other" where no route matched
        self.request_duration = Histogram(P + "request_duration_seconds", "HTTP request duration by endpoint template.",
                                          ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram(P + "inter_token_latency_seconds", "Time between a row's tokens.",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(P + "queue_wait_seconds", "Arrival to admission into the batch.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram(P + "batch_size", "Rows in each decode forward.",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.running = Gauge(P + "requests_running", "Rows in the running batch.", registry=r)
        self.waiting = Gauge(P + "requests_waiting", "Requests in the waiting queue.", registry=r)
        # tenant: a configured tenant's name (server.tenancy.tenants), never a key: bounded cardinality
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted.", ["tenant"], registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", ["tenant"], registry=r)
        self.prefix_cache_queries = Counter(P + "prefix_cache_query_tokens",
                                            "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_cache_hits = Counter(P + "prefix_cache_hit_tokens",
                                         "Prompt tokens whose KV the prefix cache held.", registry=r)
        self.prefix_cache_blocks = Gauge(P + "prefix_cache_blocks", "Blocks of prompt KV in the prefix cache.",
                                         registry=r)
        self.tenant_refused = Counter(P + "tenant_refused", "Requests a tenant's own cap refused, by limit.",
                                      ["tenant", "limit"], registry=r)
        self.adapter_cache = Counter(P + "adapter_cache_requests",
                                     "Adapter lookups by tier and result (hit, miss, error = Redis failed, "
                                     "corrupt = undecodable entry, dropped).",
                                     ["tier", "result"], registry=r)
        self.materialize_seconds = Histogram(P + "adapter_materialize_seconds",
                                             "Computing a task's adapter from skills (L3).",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.tasks_registered = Gauge(P + "tasks_registered", "Tasks in the registry.", registry=r)
        self.jobs = Counter(P + "jobs", "Adaptation jobs by final status.", ["status"], registry=r)
        self.redis_errors = Counter(P + "redis_errors", "Redis calls that failed or timed out.", registry=r)
        # a registration takes seconds (retrieve) to minutes (a loaded host, many steps): buckets span both
        self.adaptation_seconds = Histogram(P + "adaptation_seconds", "Wall time of successful adaptation jobs.",
                                            buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
                                            registry=r)
        for status in ("succeeded", "failed", "cancelled"):
            self.jobs.labels(status=status)  # export zeros so dashboards and rate() see the series

    def render(self) -> bytes:
        return generate_latest(self.registry)
