"""Write a wider procedural training suite as JSONL for `polyserve train --suite PATH.jsonl`.

The shipped suite trains on 48 tasks (16 primitives, 20 pairs, 12 triples). This keeps those 48
and the same 16 held-out tasks (build_suite draws both from the same shuffles, so asking for more
training compositions only appends to the training list) and adds more pairs and triples: an
inventory trained on more compositions, measured on the held-out tasks it has never seen
(docs/RESULTS.md 9.10).

    .venv/bin/python scripts/wide_suite.py --pairs 100 --triples 92 --out /tmp/wide_suite.jsonl

It also prints, for each held-out task, the training task that agrees with it on the most of 2,000
random inputs, and on what share: no training task computes a held-out task's function (build_suite
keeps every task distinct on its probes), and this says how close the nearest one comes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from training.suite import TaskSpec, build_suite, examples, random_input


def nearest_training_task(held: TaskSpec, train: list[TaskSpec], inputs: list[str]) -> tuple[float, str]:
    """(share of `inputs` on which they agree, name) of the training task closest to `held`."""
    want = [held.apply(x) for x in inputs]
    return max((sum(t.apply(x) == w for x, w in zip(inputs, want)) / len(inputs), t.name) for t in train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, required=True, help="training pairs (the shipped suite: 20)")
    ap.add_argument("--triples", type=int, required=True, help="training triples (the shipped suite: 12)")
    ap.add_argument("--examples-per-task", type=int, default=500)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    shipped = build_suite(0)
    wide = build_suite(0, n_pairs=(args.pairs, 8), n_triples=(args.triples, 8))
    held = {t.name for t in shipped.heldout_tasks}
    names = [t.name for t in wide.train_tasks]
    if [t.name for t in wide.heldout_tasks] != [t.name for t in shipped.heldout_tasks]:
        raise SystemExit("the held-out tasks changed: refusing (they must stay the shipped suite's 16)")
    if not {t.name for t in shipped.train_tasks} <= set(names) or held & set(names):
        raise SystemExit("the wide suite must contain the shipped training tasks and no held-out task")
    want = 16 + args.pairs + args.triples
    if len(names) != want:
        raise SystemExit(f"only {len(names)} distinct training tasks exist for that request, not {want}")
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for task in wide.train_tasks:
            for ex in examples(task, args.examples_per_task, seed=0, split="train"):
                f.write(json.dumps({"task": ex.task, "input": ex.input, "output": ex.output}) + "\n")
    tmp.replace(args.out)
    rng = random.Random(7)
    inputs = [random_input(rng) for _ in range(2000)]
    for task in wide.heldout_tasks:
        share, name = nearest_training_task(task, wide.train_tasks, inputs)
        print(f"held-out {task.name:28s} nearest training task {name:28s} agrees on {share:.1%} of 2,000 inputs")
    print(f"{args.out}: {len(names)} training tasks ({len(names) - len(shipped.train_tasks)} beyond the shipped "
          f"48) x {args.examples_per_task} examples; the 16 held-out tasks excluded")


if __name__ == "__main__":
    main()
