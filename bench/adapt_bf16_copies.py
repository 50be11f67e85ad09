"""One routing adaptation (the default recipe, no retrieval) on the shipped inventory, timed with
and without bf16 copies of the frozen weights (training.precision.FrozenBf16Weights), alternating
in one process; both under bf16 autocast. The eval loss must come out the same in every run.

    .venv/bin/python bench/adapt_bf16_copies.py --store /tmp/shipped_store --rounds 3 --threads 2

(--store: a store with the shipped inventory, e.g. made by training.default_inventory.install_default_inventory)
"""

from __future__ import annotations

import argparse
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
from training.suite import build_suite, examples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", required=True)
    ap.add_argument("--task", type=int, default=0, help="index among the suite's held-out tasks")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bb = load_backbone("default")
    info, skills = Store(args.store).load_inventory(bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    skills = {k: v.float() for k, v in skills.items()}
    task = build_suite(0).heldout_tasks[args.task]
    few = examples(task, 16, seed=1000, split="train")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for copies in (False, True):
            job = Adaptation(rm, info, skills, few, bb.tokenizer, method="routing", seed=0, autocast="bf16")
            job._bf16_weights.enabled = copies
            started = time.perf_counter()
            while job.step():
                pass
            times[copies].append(time.perf_counter() - started)
            print(f"{'bf16 copies' if copies else 'casts':12s} {times[copies][-1]:6.2f} s  eval loss "
                  f"{job.result().metrics['eval_loss']!r}", flush=True)
    for copies, ts in times.items():
        print(f"mean {'bf16 copies' if copies else 'casts':12s} {sum(ts) / len(ts):6.2f} s")


if __name__ == "__main__":
    main()
