"""What a routing-registered held-out task gets wrong (docs/RESULTS.md 9.9).

For each named composition: retrieval, then the default routing adaptation (seed 0, k = 16), then
greedy outputs on 16 test inputs, each compared with the outputs of every ordering and subset of
the task's primitives: a prediction that equals one of them is a mis-routed composition (a
primitive skipped or the order swapped); one that equals none is an execution error.

    .venv/bin/python -m scripts.failure_modes --store /tmp/shipped_store rev-words.caesar rev-words.double
"""

from __future__ import annotations

import itertools

from adapters_store.store.materialize import task_layers
from bench.adaptation_setup import load, parser
from training.adapt import adapt
from training.adapt_config import AdaptConfig
from training.evaluate import exact, generate
from training.retrieve import MAX_CANDIDATES, retrieve
from training.suite import TaskSpec, examples, parse_task


def main() -> None:
    ap = parser(__doc__, rounds=1)
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto")
    ap.add_argument("tasks", nargs="+")
    s = load(ap.parse_args())
    for name in s.args.tasks:
        task = parse_task(name)
        few = examples(task, 16, seed=1000, split="train")
        test = examples(task, 16, seed=0, split="test")
        library = s.store.routing_rows(limit=MAX_CANDIDATES, exclude=name)  # what a registration retrieves from
        found = retrieve(s.rm, s.info, library, few, s.tokenizer, autocast=s.args.autocast)
        res = adapt(s.rm, s.info, s.skills, few, s.tokenizer, AdaptConfig(method="routing", autocast=s.args.autocast),
                    init_row=found.tensors["logits"])
        preds = generate(s.rm, task_layers(s.info, s.skills, res.kind, res.tensors), s.tokenizer,
                         [ex.input for ex in test], max_new_tokens=40)
        alternatives = [TaskSpec(".".join(p), p) for k in range(1, len(task.primitives) + 1)
                        for p in itertools.permutations(task.primitives, k) if p != task.primitives]
        right = misrouted = 0
        print(f"== {name}: retrieved {found.metrics.get('retrieved')}")
        for ex, pred in zip(test, preds, strict=True):
            other = [a.name for a in alternatives if exact(pred, a.apply(ex.input))]
            right += exact(pred, ex.output)
            misrouted += bool(other) and not exact(pred, ex.output)
            print(f"  {ex.input!r:34} want {ex.output.strip()!r:34} got {pred.strip()!r:34} {other or ''}")
        print(f"  right {right}/16, another composition {misrouted}/16, neither {16 - right - misrouted}/16")


if __name__ == "__main__":
    main()
