"""One routing adaptation (the default recipe, no retrieval) on the shipped inventory, timed with
and without bf16 copies of the frozen weights (training.precision.FrozenBf16Weights), alternating
in one process; both under bf16 autocast. The eval loss must come out the same in every run.

    .venv/bin/python -m bench.experiments.adapt_bf16_copies --store /tmp/shipped_store --rounds 3 --threads 2

(--store: a store with the shipped inventory, e.g. made by training.shipped_inventory.install_default_inventory)
"""

from __future__ import annotations

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
from bench.adaptation_setup import load, parser, run_to_end
from training.adapt import Adaptation
from training.adapt_config import AdaptConfig


def main() -> None:
    s = load(parser(__doc__, rounds=3).parse_args())
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(s.args.rounds):
        for copies in (False, True):
            config = AdaptConfig(method="routing", seed=0, autocast="bf16")
            job = Adaptation(s.rm, s.info, s.skills, s.few, s.tokenizer, config)
            job._bf16_weights.enabled = copies
            times[copies].append(run_to_end(job))
            print(f"{'bf16 copies' if copies else 'casts':12s} {times[copies][-1]:6.2f} s  eval loss "
                  f"{job.result().metrics['eval_loss']!r}", flush=True)
    for copies, ts in times.items():
        print(f"mean {'bf16 copies' if copies else 'casts':12s} {sum(ts) / len(ts):6.2f} s")


if __name__ == "__main__":
    main()
