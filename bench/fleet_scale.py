"""A replica on the PostgreSQL store with many tasks: how long a new replica takes to be ready,
how long /v1/models takes, and one task's resolution (record read + cache) after warm-up.

    python -m bench.fleet_scale --tasks 10000 [--backbone tiny|default] [--requests 2000]

It creates a throwaway database on the local PostgreSQL (dropped at the end), installs the
inventory of a tiny test store (or the shipped one with --backbone default), adds --tasks
synthetic routing rows, then starts `polyserve serve` as a new replica with an empty
POLYSERVE_HOME/inventories and times: start -> /ready, GET /v1/models (the first after /ready, then
--models-calls more), GET /v1/tasks, and resolutions of random
tasks through the registry (TaskRegistry.resolve in the bench process, on its own store connection),
plus one re-scan's cost. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]


def _pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--backbone", choices=["tiny", "default"], default="tiny")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--models-calls", type=int, default=10)
    args = ap.parse_args()

    from adapters_store.store import open_store
    from server.jobs.service import Registration
    from server.registry.tasks import TaskRegistry
    from tests.server.jobs.test_registration_api import wait_process_ready
    from tests.support.pg_utils import temp_database
    from tests.support.server_fixtures import build_store, free_port

    with tempfile.TemporaryDirectory() as tmp, temp_database("polyserve_bench") as dsn:
        store = open_store(dsn)
        if args.backbone == "tiny":
            src = build_store(Path(tmp) / "src", tasks=())
            info, skills = src.inventory_bytes()
            store.import_inventory(info, skills)
        else:
            from training.shipped_inventory import install_default_inventory

            install_default_inventory(store)
        info = store.inventory_info()
        shape = (len(info.layer_names), info.spec.n_heads, info.spec.n_skills)
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        names = [f"synthetic-{i:05d}" for i in range(args.tasks)]
        for name in names:
            store.put_routing(name, torch.randn(shape, generator=gen), method="synthetic")
        fill_s = time.perf_counter() - t0

        home = Path(tmp) / "new-node"
        home.mkdir()
        if args.backbone == "default":  # the dequantised backbone is a node's own cache, not the store's
            shared = Path(os.environ.get("POLYSERVE_HOME", Path.home() / ".cache" / "polyserve"))
            for entry in shared.iterdir():
                if entry.name not in ("store", "inventories"):
                    (home / entry.name).symlink_to(entry)
        port = free_port()
        env = {**os.environ, "POLYSERVE_HOME": str(home), "POLYSERVE_STORE": dsn, "POLYSERVE_BACKBONE": args.backbone}
        env.pop("POLYSERVE_REDIS_URL", None)
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port)], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_process_ready(proc, url, timeout=300)
            ready_s = time.perf_counter() - t0
            models, listed = [], []
            with httpx.Client(base_url=url, timeout=60) as c:
                t = time.perf_counter()
                c.get("/v1/models").raise_for_status()  # the first one after /ready (also a warm-up)
                models_first = time.perf_counter() - t
                for _ in range(args.models_calls):
                    t = time.perf_counter()
                    r = c.get("/v1/models")
                    models.append(time.perf_counter() - t)
                    assert r.status_code == 200 and len(r.json()["data"]) >= args.tasks
                for _ in range(args.models_calls):
                    t = time.perf_counter()
                    r = c.get("/v1/tasks")
                    listed.append(time.perf_counter() - t)
                    assert r.status_code == 200 and len(r.json()["data"]) >= args.tasks
        finally:
            proc.terminate()
            proc.wait(30)

        registry = TaskRegistry(store, cache=None)  # records and visibility: what every request pays
        rng = random.Random(0)
        for name in rng.sample(names, min(200, len(names))):  # warm-up
            registry.get(name)
        times = []
        for _ in range(args.requests):
            name = rng.choice(names)
            t = time.perf_counter()
            registry.get(name)
            times.append(time.perf_counter() - t)

        reg = Registration.__new__(Registration)  # one quiet re-scan, as a replica runs every second
        reg._forget = lambda task: None
        reg.rt = type("Rt", (), {"store": store})()
        reg._versions, reg._cursor, reg._quiet = store.task_stamps(), None, 0
        for _ in range(3):
            reg._changed_elsewhere(None)
        t = time.perf_counter()
        for _ in range(100):
            reg._changed_elsewhere(None)
        rescan_ms = (time.perf_counter() - t) / 100 * 1e3
        t = time.perf_counter()
        store.task_stamps()
        stamps_ms = (time.perf_counter() - t) * 1e3
        store.close()
    print(json.dumps({
        "tasks": args.tasks, "backbone": args.backbone, "fill_seconds": round(fill_s, 1),
        "new_replica_ready_seconds": round(ready_s, 2),
        "models_first_ms": round(models_first * 1e3, 1),
        "models_ms_p50": round(statistics.median(models) * 1e3, 1), "models_ms_max": round(max(models) * 1e3, 1),
        "tasks_list_ms_p50": round(statistics.median(listed) * 1e3, 1),
        "resolve_ms_p50": round(_pct(times, 0.5) * 1e3, 3), "resolve_ms_p99": round(_pct(times, 0.99) * 1e3, 3),
        "quiet_rescan_ms": round(rescan_ms, 3), "full_stamps_read_ms": round(stamps_ms, 1),
    }))


if __name__ == "__main__":
    main()
