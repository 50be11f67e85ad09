"""Where a routing registration's time goes, stage by stage: the retrieval's screen and choice, then
each training step and held-out evaluation, in-process on the shipped inventory, with the 16
examples of a held-out BIG-bench task that scripts.compare_methods draws for a seed.

    .venv/bin/python -m bench.registration_stages --task bb-dyck_languages --store STORE --repeats 2
    # --steps N: another step budget; --seed S: another draw of the examples and split
    # --profile N: torch.profiler over training steps 2..N+1: the ops by their own CPU time, then by
    # op and input shape

STORE: a store with the shipped inventory (`polyserve serve` installs it, or
training.shipped_inventory.install_default_inventory). The BIG-bench cache comes from
scripts/bigbench_suite.py.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

from adapters_store.backbone.load import load_backbone
from adapters_store.lora.inject import RoutedModel
from adapters_store.store.directory import DirectoryStore
from training.adapt import Adaptation
from training.adapt_config import AdaptConfig
from training.bigbench import load_cache
from training.retrieve import MAX_CANDIDATES, Retrieval, RetrievedAdaptation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="bb-dyck_languages", help="a held-out BIG-bench task id")
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: the method's)")
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile N training steps (after the first) and print the ops by self CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    held = {t.id: t for t in load_cache() if t.heldout}
    if args.task not in held:
        ap.error(f"--task: one of {sorted(held)}")
    pool = held[args.task].examples("train") + held[args.task].examples("valid")
    few = random.Random(f"{args.task}/{args.seed}").sample(pool, min(args.k, len(pool)))  # compare_methods' draw
    bb = load_backbone("default")
    store = DirectoryStore(args.store)
    info, skills = store.load_inventory(expected_fingerprint=bb.fingerprint)
    rm = RoutedModel(bb.model, info.spec)
    rm.load_skills(skills)
    skills = {k: v.float() for k, v in skills.items()}
    candidates = store.routing_rows(limit=MAX_CANDIDATES, exclude=args.task)
    for repeat in range(args.repeats):
        retrieval = Retrieval(rm, info, candidates, few, bb.tokenizer, seed=args.seed)
        job = RetrievedAdaptation(retrieval, lambda row, known: Adaptation(
            rm, info, skills, few, bb.tokenizer, AdaptConfig(seed=args.seed, steps=args.steps),
            init_row=row, init_eval=known))
        spent: dict[str, list[float]] = defaultdict(list)
        profiler = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
                    if args.profile else None)
        started = time.perf_counter()
        while True:
            a = job.adaptation
            stage = retrieval.stage if a is None else ("evaluate" if a._need_eval else "train")
            if profiler is not None and stage == "train" and len(spent["train"]) == 1:
                profiler.start()  # the first step is left out: it pays one-time costs
            t = time.perf_counter()
            more = job.step()
            spent[stage].append(time.perf_counter() - t)
            if profiler is not None and stage == "train" and len(spent["train"]) == args.profile + 1:
                profiler.stop()
                print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
                print(profiler.key_averages(group_by_input_shape=True).table(
                    sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=70),
                    flush=True)
            if not more:
                break
        total = time.perf_counter() - started
        parts = ", ".join(f"{stage} {sum(ts):.1f} s ({len(ts)} x {min(ts):.2f}-{max(ts):.2f})"
                          for stage, ts in spent.items())
        m = job.result().metrics
        print(f"{args.task} repeat {repeat}: {total:.1f} s = {parts}; steps {m['steps_run']}, held-out loss "
              f"{m['retrieve_eval_loss']:.3f} retrieved -> {m['eval_loss']:.3f}", flush=True)


if __name__ == "__main__":
    main()
