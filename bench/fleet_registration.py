"""Registration on a worker vs inside the serving replica, on the default backbone and
the shipped inventory, with a PostgreSQL store (a throwaway database) and everything over HTTP.

On a 2-core machine the serving replica is pinned to core 0 and the worker to core 1 (`taskset`),
each with one torch thread and one fixed dtype (--dtype: the `auto` probe could pick differently
per process on a loaded host); this script (the HTTP load and the registration client) runs on
the replica's core (--client-core), so in every phase the traffic costs the replica the same.
Two configurations, each started fresh on the same database:

    worker     replica POLYSERVE_JOBS=off (core 0) + `polyserve worker` (core 1)
    in-process replica POLYSERVE_JOBS=local (core 0): jobs run between its decode steps

    burner     replica POLYSERVE_JOBS=off (core 0) + a process that is not polyserve, one torch thread
               multiplying 1024x1024 matrices on core 1: what any busy neighbour core costs the
               replica on this host (shared caches, memory, the VM, the host's other tenants),
               the ceiling of "kept" for a worker there

For each: the replica's generation throughput (bench/http_load.py's closed loop: --clients each
keep one /v1/generate in flight) idle, then while registrations (a held-out task, --k examples,
method routing) are submitted back to back, then idle again -> "kept" = busy / the mean of the
two idle phases of the same replica (the host's other load drifts); then the wall time of
--repeats registrations on the idle replica (the job's finished_at - created_at).

    .venv/bin/python -m bench.fleet_registration --seconds 60 --repeats 3 --json /tmp/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import httpx
import psycopg

from adapters_store.backbone.load import warm_default_cache
from bench.http_load import http_clients, report, workload
from bench.local_server import polyserve_server
from training.suite import build_suite, examples

TERMINAL = ("succeeded", "failed", "cancelled")


def register(url: str, task: str, train: list[dict[str, str]], stop: threading.Event | None = None) -> dict:
    """POST /v1/tasks, poll the job every 0.1 s until it ends; returns the final job."""
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/tasks", json={"task": task, "examples": train})
        if r.status_code != 202:
            raise SystemExit(f"registration refused: {r.status_code} {r.text[:300]}")
        job = r.json()
        while job["status"] not in TERMINAL:
            time.sleep(0.1)
            job = c.get(f"/v1/jobs/{job['id']}").json()
    return job


def throughput(args, url: str, tasks: list[str], seconds: float, name: str) -> float:
    load = SimpleNamespace(clients=args.clients, new_tokens=args.new_tokens, seconds=seconds)
    tokens, elapsed, latencies = asyncio.run(http_clients(load, url, tasks))
    return report(name, tokens, elapsed, latencies)


BURNER = "import torch\ntorch.set_num_threads(1)\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n"


def measure(args, url: str, label: str, train_sets: list[list[dict[str, str]]]) -> dict:
    tasks = [t["id"] for t in httpx.get(url + "/v1/tasks").json()["data"] if t["status"] == "ready"]
    tasks = [t for t in workload(0)[1] if t in tasks]
    throughput(args, url, tasks, args.warmup_seconds, f"{label}: warm-up")
    idle_before = throughput(args, url, tasks, args.seconds, f"{label}: idle")
    stop, jobs = threading.Event(), []

    def back_to_back() -> None:
        i = 0
        while not stop.is_set():
            jobs.append(register(url, f"busy-{label}-{i}", train_sets[i % len(train_sets)]))
            i += 1

    if label == "burner":
        burner = subprocess.Popen(["taskset", "-c", str(args.worker_core), sys.executable, "-c", BURNER])
        time.sleep(1.0)
        try:
            busy = throughput(args, url, tasks, args.seconds, f"{label}: a matmul loop on core {args.worker_core}")
        finally:
            burner.kill()
            burner.wait()
        idle_after = throughput(args, url, tasks, args.seconds, f"{label}: idle again")
        return {"tokens_per_s_idle_before": round(idle_before, 2), "tokens_per_s_idle_after": round(idle_after, 2),
                "tokens_per_s_busy": round(busy, 2), "kept": round(2 * busy / (idle_before + idle_after), 3)}
    thread = threading.Thread(target=back_to_back, daemon=True)
    thread.start()
    time.sleep(1.0)  # the first job is claimed and running
    busy = throughput(args, url, tasks, args.seconds, f"{label}: registrations back to back")
    stop.set()
    thread.join()
    idle_after = throughput(args, url, tasks, args.seconds, f"{label}: idle again")
    idle = (idle_before + idle_after) / 2
    latencies = []
    for i in range(args.repeats):
        job = register(url, f"idle-{label}-{i}", train_sets[i % len(train_sets)])
        if job["status"] != "succeeded":
            raise SystemExit(f"registration {job['id']} ended {job['status']}: {job.get('error')}")
        latencies.append(job["finished_at"] - job["created_at"])
    print(f"{label}: registration wall on the idle replica {statistics.fmean(latencies):.2f} s "
          f"(runs: {', '.join(f'{x:.2f}' for x in latencies)})", flush=True)
    return {"tokens_per_s_idle_before": round(idle_before, 2), "tokens_per_s_idle_after": round(idle_after, 2),
            "tokens_per_s_idle": round(idle, 2), "tokens_per_s_busy": round(busy, 2),
            "kept": round(busy / idle, 3), "jobs_during_busy": len(jobs),
            "jobs_succeeded_during_busy": sum(j["status"] == "succeeded" for j in jobs),
            "registration_wall_s": [round(x, 2) for x in latencies],
            "registration_wall_s_mean": round(statistics.fmean(latencies), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60, help="each throughput phase")
    ap.add_argument("--warmup-seconds", type=float, default=5)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="registrations timed on the idle replica")
    ap.add_argument("--serve-core", type=int, default=0)
    ap.add_argument("--worker-core", type=int, default=1)
    ap.add_argument("--client-core", type=int, default=None, help="this script's core [default: --serve-core]")
    ap.add_argument("--dtype", default="float32", help="the replica's serving dtype (POLYSERVE_DTYPE)")
    ap.add_argument("--admin-dsn", default=os.environ.get("POLYSERVE_TEST_PG",
                                                          "postgresql://postgres@127.0.0.1:5432/postgres"))
    ap.add_argument("--modes", default="worker,in-process,burner")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.environ.pop("POLYSERVE_REDIS_URL", None)  # no L2: the store alone
    modes = args.modes.split(",")
    if not modes or set(modes) - {"worker", "in-process", "burner"}:
        raise SystemExit(f"--modes takes worker, in-process and/or burner, got {args.modes!r}")
    client_core = args.serve_core if args.client_core is None else args.client_core
    cores = {args.serve_core, args.worker_core, client_core}
    if not cores <= os.sched_getaffinity(0):
        raise SystemExit(f"cores {sorted(cores)} are not all available here ({sorted(os.sched_getaffinity(0))})")
    cache = warm_default_cache().parent  # the dequantised backbone, shared read-only by every home
    os.sched_setaffinity(0, {client_core})  # the load and the registration client
    suite = build_suite()
    train_sets = [[{"input": e.input, "output": e.output} for e in examples(t, args.k, seed=0, split="train")]
                  for t in suite.heldout_tasks[:4]]
    name = f"polyserve_bench_fleet_{os.getpid()}"
    with psycopg.connect(args.admin_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    dsn = args.admin_dsn.rsplit("/", 1)[0] + "/" + name
    out: dict = {"clients": args.clients, "new_tokens": args.new_tokens, "seconds": args.seconds, "k": args.k,
                 "serve_core": args.serve_core, "worker_core": args.worker_core, "client_core": client_core,
                 "dtype": args.dtype, "load_avg_start": os.getloadavg()}
    try:
        for mode in modes:
            with ExitStack() as stack:
                homes = {}
                for role in ("serve", "worker"):
                    homes[role] = Path(tempfile.mkdtemp(prefix=f"polyserve-fleet-{role}-"))
                    (homes[role] / "backbones").symlink_to(cache)
                    stack.callback(lambda h=homes[role]: __import__("shutil").rmtree(h, ignore_errors=True))
                common = {"POLYSERVE_STORE": dsn, "POLYSERVE_THREADS": "1", "POLYSERVE_BACKBONE": "default",
                          "POLYSERVE_DTYPE": args.dtype}
                url = stack.enter_context(polyserve_server(
                    {**common, "POLYSERVE_HOME": str(homes["serve"]), "POLYSERVE_MAX_BATCH_ROWS": str(args.clients),
                     "POLYSERVE_JOBS": "local" if mode == "in-process" else "off"},
                    prefix=("taskset", "-c", str(args.serve_core))))
                if mode == "worker":
                    stack.enter_context(polyserve_server({**common, "POLYSERVE_HOME": str(homes["worker"])},
                                                         command="worker",
                                                         prefix=("taskset", "-c", str(args.worker_core))))
                out[mode] = measure(args, url, mode, train_sets)
    finally:
        with psycopg.connect(args.admin_dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    out["load_avg_end"] = os.getloadavg()
    if "worker" in out and "in-process" in out:
        out["registration_wall_worker_over_in_process"] = round(
            out["worker"]["registration_wall_s_mean"] / out["in-process"]["registration_wall_s_mean"], 3)
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
