"""Task search at scale: GET /v1/tasks/{task}/similar's index (server/registry/similar_index.py) over N
tasks of the shipped inventory's shape (120 linears x 8 heads x 8 skills = 7,680 numbers a row).

The library: the shipped tasks' routing rows, then clusters around them (a shipped row plus
Gaussian noise on its logits), up to N tasks, written into a fresh store with the shipped
inventory. Measured: the warm-up (the index reads every task; a server starts it in the
background), a query when nothing changed (a stat per task, one GEMV, a shortlist of exact
rescoring reads), a query after one task changed, the index's memory, and recall@k of the
shortlist against the exact ranking (brute force over every row in memory).

    .venv/bin/python -m bench.similar_tasks --tasks 10000 --queries 50 --out /tmp/similar-bench
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.lora.similar import rank_exact
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.materialize import task_weights
from server.registry.similar_index import RoutingIndex
from training.shipped_inventory import PACKAGE_DIR as DEFAULT_INVENTORY_DIR


def build(root: Path, n_tasks: int, noise: float, seed: int) -> DirectoryStore:
    shutil.rmtree(root, ignore_errors=True)
    (root / "inventory").parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(DEFAULT_INVENTORY_DIR / "inventory", root / "inventory")
    (root / "tasks").mkdir()
    shipped = DirectoryStore(DEFAULT_INVENTORY_DIR)
    centres = [shipped.load_routing(r.id).float() for r in shipped.list_tasks() if r.kind == "routing"]
    store = DirectoryStore(root)
    gen = torch.Generator().manual_seed(seed)
    for i in range(n_tasks):
        c = centres[i % len(centres)]
        row = c if i < len(centres) else c + noise * torch.randn(c.shape, generator=gen)
        store.put_routing(f"t{i:05d}", row, method="bench")
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10000)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--noise", type=float, default=1.0, help="std of the noise on a cluster member's logits")
    ap.add_argument("--out", default="/tmp/similar-bench", help="the store is (re)built here")
    ap.add_argument("--reuse", action="store_true", help="use the store already at --out")
    args = ap.parse_args()
    root = Path(args.out)
    started = time.perf_counter()
    store = DirectoryStore(root) if args.reuse else build(root, args.tasks, args.noise, seed=0)
    print(f"store: {args.tasks} tasks written in {time.perf_counter() - started:.1f} s")
    info = store.inventory_info()
    index = RoutingIndex(store, info)
    gen = torch.Generator().manual_seed(1)
    ids = sorted(store.task_stamps())
    queries = [ids[int(i)] for i in torch.randint(len(ids), (args.queries,), generator=gen)]

    t = time.perf_counter()
    index.warm()  # what a server starts in the background
    first = time.perf_counter() - t
    warm = []
    for q in queries:
        t = time.perf_counter()
        index.similar(q, args.k)
        warm.append(time.perf_counter() - t)
    index.max_staleness = 0.0  # every query stats every task
    fresh = []
    for q in queries[:10]:
        t = time.perf_counter()
        index.similar(q, args.k)
        fresh.append(time.perf_counter() - t)
    t = time.perf_counter()
    changed = index.refresh()
    stat_only = time.perf_counter() - t
    store.put_routing(ids[0], store.load_routing(ids[0]) + 0.1, method="bench")
    t = time.perf_counter()
    index.similar(queries[0], args.k)
    after_change = time.perf_counter() - t

    rows = torch.stack([task_weights(info, store.load_routing(i).float()) for i in ids])  # exact reference
    hits = 0
    for q in queries:
        exact = {ids[j] for j, _ in rank_exact(rows[ids.index(q)], rows, args.k, exclude=ids.index(q))}
        hits += len(exact & {t for t, _ in index.similar(q, args.k)})
    mem = index._matrix.numel() * index._matrix.element_size() + (
        0 if index.P is None else index.P.numel() * index.P.element_size())
    print(f"tasks {len(index)}, row {rows[0].numel()} numbers, projected to {index._matrix.shape[1]}, "
          f"shortlist {index.shortlist}, threads {torch.get_num_threads()}")
    print(f"warm-up (reads every task once)     {first * 1e3:9.1f} ms")
    print(f"query within max_staleness: p50     {statistics.median(warm) * 1e3:9.1f} ms   "
          f"max {max(warm) * 1e3:.1f} ms  ({len(warm)} queries)")
    print(f"query with a refresh: p50           {statistics.median(fresh) * 1e3:9.1f} ms   "
          f"max {max(fresh) * 1e3:.1f} ms  ({len(fresh)} queries)")
    print(f"refresh alone (stats, {changed} changed)  {stat_only * 1e3:9.1f} ms")
    print(f"query after one task changed        {after_change * 1e3:9.1f} ms")
    print(f"index memory                        {mem / 2**20:9.1f} MiB  (full rows would be "
          f"{rows.numel() * 4 / 2**20:.0f} MiB)")
    print(f"recall@{args.k} vs exact                    {hits / (args.k * len(queries)):9.3f}")


if __name__ == "__main__":
    main()
