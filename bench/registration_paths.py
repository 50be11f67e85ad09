"""One registration (a held-out task of the suite, k examples, default settings) three ways, on a
fresh copy of the shipped store each: `polyserve adapt` (the CLI, its own process), and
`polyserve serve` over HTTP (POST /v1/tasks, then GET /v1/jobs/{id} every 0.5 s, the Python
client's interval, until it finishes) on an idle server. Reports, per method, the wall time of
each path (the server's: the job's own finished_at - created_at) and the adaptation's own seconds
(the job's / the CLI's metrics): what the server adds to a registration.

    .venv/bin/python -m bench.registration_paths --methods routing,retrieve --repeats 2 --threads 2

--serve-early registers over HTTP with `"serve_early": true` and also reports when the first
version became servable (its job event's time less the job's creation).

--inventories A,B times the same registrations on other inventories in the shipped layout
(`training/default_inventory`, e.g. an older one from `git archive`), alternated with each other
run by run: seconds differ 2x between hosts here, so a comparison of inventories is one run's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from adapters_store.backbone.home import polyserve_home
from adapters_store.store.directory import DirectoryStore
from bench.local_server import polyserve_server
from training.bigbench import load_cache
from training.shipped_inventory import install_default_inventory
from training.suite import build_suite, examples

ROOT = Path(__file__).resolve().parents[1]
POLYSERVE = [sys.executable, "-m", "server.cli"]


def fresh_home(cache: Path, inventory: Path | None = None) -> Path:
    home = Path(tempfile.mkdtemp(prefix="polyserve-reg-"))
    (home / "backbones").symlink_to(cache / "backbones")  # the dequantised backbone, not rebuilt
    if not install_default_inventory(DirectoryStore(home / "store"), inventory):
        raise SystemExit(f"no inventory installed from {inventory or 'the shipped one'}")
    return home


def via_cli(args, home: Path, method: str, jsonl: Path) -> tuple[float, float]:
    env = {**os.environ, "POLYSERVE_HOME": str(home)}
    started = time.perf_counter()
    out = subprocess.run([*POLYSERVE, "adapt", "--task", "new-task", "--examples", str(jsonl), "--method", method,
                          "--store", str(home / "store"), "--threads", str(args.threads)],
                         env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return wall, float(json.loads(line)["metrics"].get("seconds", float("nan")))


def via_http(args, home: Path, method: str, train: list) -> tuple[float, float]:
    env = {"POLYSERVE_HOME": str(home), "POLYSERVE_STORE": str(home / "store"), "POLYSERVE_THREADS": str(args.threads)}
    body = {"task": "new-task", "method": method, "examples": [{"input": e.input, "output": e.output} for e in train],
            **({"serve_early": True} if args.serve_early else {})}
    with polyserve_server(env) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            job = c.post("/v1/tasks", json=body).json()
            while True:
                job = c.get(f"/v1/jobs/{job['id']}").json()
                if job["status"] in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.5)  # the Python client's poll interval
            wall = job["finished_at"] - job["created_at"]
            if args.serve_early:
                events = c.get(f"/v1/jobs/{job['id']}/events").json()["data"]
                first = [e for e in events if e["data"].get("version") == 1 and "while training" in e["message"]]
                print(f"    first version servable after {first[0]['created_at'] - job['created_at']:.2f} s "
                      f"({first[0]['message']})" if first else "    no early version", flush=True)
        if job["status"] != "succeeded":
            raise SystemExit(f"the job ended {job['status']}: {job.get('error')}")
    return wall, float(job["metrics"].get("seconds", float("nan")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="routing,retrieve")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="cli,http", help="cli (polyserve adapt), http (polyserve serve)")
    ap.add_argument("--task", default=None,
                    help="a held-out task of the procedural suite (default: its first), of the BIG-bench suite "
                         "(bb-..., its longer examples; scripts/bigbench_suite.py builds it) or of the small real "
                         "tasks (real-capital, ...: training/real_tasks.py, seed 0's draw)")
    ap.add_argument("--serve-early", action="store_true", help="http: register with serve_early")
    ap.add_argument("--inventories", default="", help="directories in the shipped layout (default: the "
                    "shipped inventory only); 'shipped' names the shipped one")
    args = ap.parse_args()
    paths = {"cli": "polyserve adapt", "http": "polyserve serve + HTTP"}
    chosen = [paths[p] for p in args.paths.split(",")]
    inventories: list[Path | None] = [None if d == "shipped" else Path(d)
                                      for d in args.inventories.split(",") if d] or [None]
    cache = polyserve_home()
    if args.task and args.task.startswith("bb-"):
        bb = {t.id: t for t in load_cache() if t.heldout}
        if args.task not in bb:
            raise SystemExit(f"{args.task} is not a held-out task of the BIG-bench suite: {sorted(bb)}")
        name, train = args.task, bb[args.task].examples("train")[: args.k]
    elif args.task and args.task.startswith("real-"):
        from training.real_tasks import REAL_TASKS, real_task_examples

        if args.task[5:] not in REAL_TASKS:
            raise SystemExit(f"{args.task}: the real tasks are {', '.join('real-' + t for t in REAL_TASKS)}")
        name, train = args.task, real_task_examples(args.task[5:], args.k, 0)[0]
    else:
        task = build_suite().task(args.task) if args.task else build_suite().heldout_tasks[0]
        name, train = task.name, examples(task, args.k, seed=0, split="train")
    jsonl = Path(tempfile.mkdtemp()) / "examples.jsonl"
    jsonl.write_text("".join(json.dumps({"input": e.input, "output": e.output}) + "\n" for e in train))
    print(f"{name}, k = {args.k}, {args.threads} threads, {args.repeats} repeats (paths alternated)")
    for method in args.methods.split(","):
        runs: dict[str, list[tuple[float, float]]] = {}
        for _ in range(args.repeats):
            for inventory in inventories:
                for path in chosen:
                    home = fresh_home(cache, inventory)
                    try:
                        run = via_cli(args, home, method, jsonl) if path == "polyserve adapt" else \
                            via_http(args, home, method, train)
                    finally:
                        shutil.rmtree(home, ignore_errors=True)
                    name = path if len(inventories) == 1 else f"{path} [{inventory.name if inventory else 'shipped'}]"
                    runs.setdefault(name, []).append(run)
        for name, rs in runs.items():
            walls, own = [w for w, _ in rs], [s for _, s in rs]
            print(f"  {method:8s} {name:36s} wall {statistics.fmean(walls):6.2f} s  "
                  f"(runs: {', '.join(f'{w:.2f}' for w in walls)}), its own seconds {statistics.fmean(own):6.2f}")


if __name__ == "__main__":
    main()
