"""Write a wider procedural training suite as JSONL for `polyserve train --suite PATH.jsonl`.

The shipped suite trains on 48 tasks (16 primitives, 20 pairs, 12 triples). This keeps those 48
and the same 16 held-out tasks (build_suite draws both from the same shuffles, so asking for more
training compositions only appends to the training list) and adds more pairs and triples: an
inventory trained on more compositions, measured on the held-out tasks it has never seen
(docs/RESULTS.md 9.10).

    .venv/bin/python -m scripts.wide_suite --pairs 103 --triples 381 --out /tmp/wide500_suite.jsonl

It also prints, for each held-out task, the training task that agrees with it on the most of 2,000
random inputs, and on what share: no training task computes a held-out task's function (build_suite
keeps every task distinct on its probes), and this says how close the nearest one comes. The far
held-out tasks (training/far_heldout.py) are never drawn for training, and the script refuses a
suite in which a training task comes nearer than FAR_BOUND to one of them (the set would no longer
be far).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from training.far_heldout import FAR_BOUND, FAR_HELDOUT, agreement_inputs, far_tasks, nearest, wide_suite
from training.suite import build_suite, examples, takes_sentences
from training.vocab import SENTENCES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, required=True, help="training pairs (the shipped suite: 20)")
    ap.add_argument("--triples", type=int, required=True, help="training triples (the shipped suite: 12)")
    ap.add_argument("--examples-per-task", type=int, default=500)
    ap.add_argument("--vocab", choices=["train", "legacy"], default="train",
                    help="the inputs' words: the open vocabulary's training side, or the first suite's 24")
    ap.add_argument("--sentences", type=int, default=0,
                    help="also this many sentence inputs per task of word-level primitives only "
                         "(training.vocab.training_sentence; the tasks training.suite.takes_sentences names)")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()

    shipped = build_suite(0)
    wide = wide_suite(args.pairs, args.triples)
    held = {t.name for t in shipped.heldout_tasks}
    names = [t.name for t in wide.train_tasks]
    if [t.name for t in wide.heldout_tasks] != [t.name for t in shipped.heldout_tasks]:
        raise SystemExit("the held-out tasks changed: refusing (they must stay the shipped suite's 16)")
    if not {t.name for t in shipped.train_tasks} <= set(names) or (held | set(FAR_HELDOUT)) & set(names):
        raise SystemExit("the wide suite must contain the shipped training tasks and no held-out task")
    far_nearest = nearest(far_tasks(), wide.train_tasks, agreement_inputs())
    too_near = [(t.name, share, name) for t, (share, name) in zip(far_tasks(), far_nearest, strict=True)
                if share > FAR_BOUND]
    if too_near:
        raise SystemExit(f"training tasks come nearer than {FAR_BOUND:.0%} to far held-out tasks: {too_near}")
    want = 16 + args.pairs + args.triples
    if len(names) != want:
        raise SystemExit(f"only {len(names)} distinct training tasks exist for that request, not {want}")
    tmp = args.out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for task in wide.train_tasks:
            rows = examples(task, args.examples_per_task, seed=0, split="train", vocab=args.vocab)
            if takes_sentences(task):
                rows += examples(task, args.sentences, seed=0, split="train", vocab=SENTENCES)
            for ex in rows:
                f.write(json.dumps({"task": ex.task, "input": ex.input, "output": ex.output}) + "\n")
    tmp.replace(args.out)
    for task, (share, name) in zip(wide.heldout_tasks, nearest(wide.heldout_tasks, wide.train_tasks,
                                                               agreement_inputs(2000)), strict=True):
        print(f"held-out {task.name:28s} nearest training task {name:28s} agrees on {share:.1%} of 2,000 inputs")
    for task, (share, name) in zip(far_tasks(), far_nearest, strict=True):
        print(f"far      {task.name:28s} nearest training task {name:28s} agrees on {share:.1%} of 1,000 inputs")
    n_sentence_tasks = sum(takes_sentences(t) for t in wide.train_tasks)
    print(f"{args.out}: {len(names)} training tasks ({len(names) - len(shipped.train_tasks)} beyond the shipped "
          f"48) x {args.examples_per_task} examples, and {args.sentences} sentences for each of {n_sentence_tasks}; "
          f"the 16 held-out and {len(FAR_HELDOUT)} far held-out tasks excluded")


if __name__ == "__main__":
    main()
