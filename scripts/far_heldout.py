"""Choose the far held-out set (training/far_heldout.py FAR_HELDOUT) and print how far each task is.

    .venv/bin/python -m scripts.far_heldout            # the choice, and the pinned set's figures
    .venv/bin/python -m scripts.far_heldout --check    # exit 1 unless the pinned set is the choice

How the set is chosen (deterministic; ~15 s on 2 cores):
1. the candidates: every composition of 1-3 primitives that build_suite could draw (the shortest
   name of its function on the probe inputs, neither identity nor constant), minus the 208 training
   tasks of the reference suite (REFERENCE_PAIRS/TRIPLES: the shipped inventory's stage 2) and the
   16 held-out tasks;
2. eligible: the nearest of the 208 training tasks agrees with it on at most FAR_BOUND (30%) of
   the 1,000 fixed random inputs (`agreement_inputs()`, seed 7);
3. in a seeded shuffle (pairs first, since few pairs are eligible, then triples), a candidate is
   taken while the set has fewer than --n tasks, if it also agrees with every task already taken on
   at most FAR_BOUND (the set does not measure one function many times) and no primitive would
   appear more than --per-primitive times in the set (every primitive is exercised, none dominates).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys

import numpy as np

from training.far_heldout import (
    FAR_BOUND,
    FAR_HELDOUT,
    REFERENCE_PAIRS,
    REFERENCE_TRIPLES,
    agreement_inputs,
    agreement_matrix,
    far_tasks,
    nearest,
    output_table,
    wide_suite,
)
from training.suite import TaskSpec, _seed, build_suite, candidate_pool


def choose(n: int, per_primitive: int) -> list[TaskSpec]:
    # chosen against the reference suite; wider suites pass over whatever comes near the choice
    suite = build_suite(0, n_pairs=(REFERENCE_PAIRS, 8), n_triples=(REFERENCE_TRIPLES, 8))
    taken_names = {t.name for t in suite.all_tasks}
    pool = [t for t in candidate_pool() if t.name not in taken_names]
    inputs = agreement_inputs()
    ids: dict[str, int] = {}
    train_out = output_table(suite.train_tasks, inputs, ids)
    pool_out = output_table(pool, inputs, ids)
    near = agreement_matrix(pool_out, train_out).max(axis=1)
    eligible = [i for i in range(len(pool)) if near[i] <= FAR_BOUND]
    rng = random.Random(_seed("far-heldout", 0))
    rng.shuffle(eligible)
    eligible.sort(key=lambda i: len(pool[i].primitives))  # stable: pairs first, each in shuffled order
    chosen: list[int] = []
    uses: collections.Counter[str] = collections.Counter()
    for i in eligible:
        if len(chosen) == n:
            break
        if any(uses[p] >= per_primitive for p in set(pool[i].primitives)):
            continue
        if chosen and agreement_matrix(pool_out[i:i + 1], pool_out[chosen]).max() > FAR_BOUND:
            continue
        chosen.append(i)
        uses.update(set(pool[i].primitives))
    print(f"{len(pool)} candidates beyond the 208 training and 16 held-out tasks; {len(eligible)} with their "
          f"nearest training task at most {FAR_BOUND:.0%} of {len(inputs)} inputs; chose {len(chosen)}")
    return [pool[i] for i in chosen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--per-primitive", type=int, default=4)
    ap.add_argument("--check", action="store_true", help="exit 1 unless FAR_HELDOUT is this choice")
    args = ap.parse_args()

    chosen = choose(args.n, args.per_primitive)
    print("FAR_HELDOUT: tuple[str, ...] = (\n" + "".join(f'    "{t.name}",\n' for t in chosen) + ")")
    pinned = far_tasks()
    if pinned:
        suite, inputs = wide_suite(), agreement_inputs()
        ids: dict[str, int] = {}
        own = output_table(pinned, inputs, ids)
        mutual = agreement_matrix(own, own)
        np.fill_diagonal(mutual, 0.0)
        for task, (share, name), other in zip(pinned, nearest(pinned, suite.train_tasks, inputs), mutual.max(1),
                                              strict=True):
            print(f"far {task.name:28s} nearest training task {name:28s} agrees on {share:6.1%}; "
                  f"nearest far task {other:6.1%}")
        uses = collections.Counter(p for t in pinned for p in set(t.primitives))
        print("primitives:", ", ".join(f"{p} {c}" for p, c in sorted(uses.items())))
    if args.check and [t.name for t in chosen] != list(FAR_HELDOUT):
        sys.exit("FAR_HELDOUT is not what this script chooses")


if __name__ == "__main__":
    main()
