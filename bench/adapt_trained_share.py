"""One routing adaptation (retrieval-initialised, the default recipe otherwise) on the shipped
inventory, timed for several (trained share, steps) settings, alternating in one process: what
training only the top share of the routing row saves (a backward pass stops at the first trained
linear). Retrieval runs once; every setting starts from its row.

    .venv/bin/python bench/adapt_trained_share.py --store /tmp/shipped_store --settings 1.0:30,0.5:30,0.5:40 \
        --rounds 3 --threads 2

(--store: a store with the shipped inventory, e.g. made by training.default_inventory.install_default_inventory)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import server  # noqa: F401  (before torch: OpenMP spin defaults, server/openmp.py)

# isort: split
import torch

from adapters_store.backbone import load_backbone
from adapters_store.inject import RoutedModel
from adapters_store.store import Store
from training.adapt import Adaptation
from training.retrieve import retrieve
from training.suite import build_suite, examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--task", type=int, default=0, help="index among the suite's held-out tasks")
    ap.add_argument("--settings", default="1.0:30,0.5:30,0.5:40", help="share:steps, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    settings = [(float(s.split(":")[0]), int(s.split(":")[1])) for s in args.settings.split(",")]
    bb = load_backbone("default")
    store = Store(args.store)
    info, skills = store.load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    skills = {k: v.float() for k, v in skills.items()}
    task = build_suite(0).heldout_tasks[args.task]
    few = examples(task, 16, seed=1000, split="train")
    candidates = {r.id: store.load_routing(r.id) for r in store.list_tasks() if r.kind == "routing"}
    init = retrieve(rm, info, candidates, few, bb.tokenizer, autocast=args.autocast).tensors["logits"]
    times: dict[tuple[float, int], list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for share, steps in settings:
            job = Adaptation(rm, info, skills, few, bb.tokenizer, method="routing", steps=steps, seed=0,
                             autocast=args.autocast, init_row=init, trained_share=share)
            started = time.perf_counter()
            while job.step():
                pass
            times[(share, steps)].append(time.perf_counter() - started)
            m = job.result().metrics
            print(f"share {share:4.2f} steps {steps:3d}  {times[(share, steps)][-1]:6.2f} s  eval loss "
                  f"{m['eval_loss']:.4f}  best step {m['best_step']}", flush=True)
    base = statistics.mean(times[settings[0]])
    print(f"{task.name}, {args.rounds} rounds, {args.threads} threads, autocast {args.autocast} "
          f"(resolved: {'bf16' if job.autocast else 'float32'})")
    for (share, steps), ts in times.items():
        mean = statistics.mean(ts)
        print(f"mean share {share:4.2f} steps {steps:3d}  {mean:6.2f} s  ({mean / base:.2f}x the first setting)")


if __name__ == "__main__":
    main()
