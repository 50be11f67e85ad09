"""One routing adaptation (retrieval-initialised, the default recipe otherwise) on the shipped
inventory, timed for several (trained share, steps) settings, alternating in one process: what
training only the top share of the routing row saves (a backward pass stops at the first trained
linear). Retrieval runs once; every setting starts from its row.

    .venv/bin/python -m bench.experiments.adapt_trained_share --store /tmp/shipped_store \
        --settings 1.0:30,0.5:30,0.5:40 --rounds 3 --threads 2

(--store: a store with the shipped inventory, e.g. made by training.shipped_inventory.install_default_inventory)
"""

from __future__ import annotations

import statistics

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
from bench.adaptation_setup import load, parser, run_to_end
from training.adapt import Adaptation
from training.adapt_config import AdaptConfig
from training.retrieve import retrieve


def main() -> None:
    ap = parser(__doc__, rounds=3)
    ap.add_argument("--settings", default="1.0:30,0.5:30,0.5:40", help="share:steps, comma-separated")
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto")
    s = load(ap.parse_args())
    args = s.args
    settings = [(float(x.split(":")[0]), int(x.split(":")[1])) for x in args.settings.split(",")]
    candidates = {r.id: s.store.load_routing(r.id) for r in s.store.list_tasks() if r.kind == "routing"}
    init = retrieve(s.rm, s.info, candidates, s.few, s.tokenizer, autocast=args.autocast).tensors["logits"]
    times: dict[tuple[float, int], list[float]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for share, steps in settings:
            config = AdaptConfig(method="routing", steps=steps, seed=0, autocast=args.autocast, trained_share=share)
            job = Adaptation(s.rm, s.info, s.skills, s.few, s.tokenizer, config, init_row=init)
            times[(share, steps)].append(run_to_end(job))
            m = job.result().metrics
            print(f"share {share:4.2f} steps {steps:3d}  {times[(share, steps)][-1]:6.2f} s  eval loss "
                  f"{m['eval_loss']:.4f}  best step {m['best_step']}", flush=True)
    base = statistics.mean(times[settings[0]])
    print(f"{s.task}, {args.rounds} rounds, {args.threads} threads, autocast {args.autocast} "
          f"(resolved: {'bf16' if job.autocast else 'float32'})")
    for (share, steps), ts in times.items():
        mean = statistics.mean(ts)
        print(f"mean share {share:4.2f} steps {steps:3d}  {mean:6.2f} s  ({mean / base:.2f}x the first setting)")


if __name__ == "__main__":
    main()
