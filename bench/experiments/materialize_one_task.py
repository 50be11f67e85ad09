"""One task's LoRA tables for every adapted linear (RoutedModel.set_materialized, what every routing
step and held-out evaluation of a registration runs), two ways, alternating in one process:

    per-layer  materialize_many per linear: two einsums each (the earlier path)
    stacked    materialize_stacked per group of same-shape linears, on skills stacked once

First the combine alone (+ its backward into the routing row), then whole routing adaptations
(the default recipe, no retrieval) on the shipped inventory; both must give the same eval loss.

    .venv/bin/python -m bench.experiments.materialize_one_task --store /tmp/shipped_store --rounds 4 --threads 2

(--store: a store with the shipped inventory, e.g. made by training.shipped_inventory.install_default_inventory)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
import torch

from adapters_store.lora.combine import materialize_many
from adapters_store.lora.inject import RoutedModel
from adapters_store.lora.routing import eval_weights
from bench.adaptation_setup import load, parser, run_to_end
from training.adapt import Adaptation
from training.adapt_config import AdaptConfig

STACKED = RoutedModel._materialize_one


def per_layer(self: RoutedModel, w: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    tables = [materialize_many(layer.lora_A, layer.lora_B, w[i].unsqueeze(0)) for i, layer in enumerate(self.layers)]
    return [a for a, _ in tables], [b for _, b in tables]


PATHS: dict[str, Callable] = {"per-layer": per_layer, "stacked": STACKED}


def combine_ms(rm: RoutedModel, calls: int) -> float:
    L, h, S = len(rm.layers), rm.spec.n_heads, rm.spec.n_skills
    row = torch.zeros(L, h, S, requires_grad=True)
    started = time.perf_counter()
    for _ in range(calls):
        rm.set_materialized(eval_weights(row), rows=4)
        plan = rm.batch.plan
        torch.stack([a.sum() + b.sum() for a, b in zip(plan.A_tables, plan.B_tables)]).sum().backward()
    return (time.perf_counter() - started) / calls * 1e3


def main() -> None:
    ap = parser(__doc__, rounds=4)
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto")
    s = load(ap.parse_args())
    args, rm = s.args, s.rm
    combine: dict[str, list[float]] = {name: [] for name in PATHS}
    adapt: dict[str, list[float]] = {name: [] for name in PATHS}
    for r in range(args.rounds):
        order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
        for name in order:
            RoutedModel._materialize_one = PATHS[name]  # type: ignore[method-assign]
            combine_ms(rm, 2)
            combine[name].append(combine_ms(rm, 10))
        for name in order:
            RoutedModel._materialize_one = PATHS[name]  # type: ignore[method-assign]
            config = AdaptConfig(method="routing", seed=0, autocast=args.autocast)
            job = Adaptation(rm, s.info, s.skills, s.few, s.tokenizer, config)
            adapt[name].append(run_to_end(job))
            print(f"{name:9s} combine + backward {combine[name][-1]:6.1f} ms   adaptation {adapt[name][-1]:6.2f} s  "
                  f"eval loss {job.result().metrics['eval_loss']!r}", flush=True)
    RoutedModel._materialize_one = STACKED  # type: ignore[method-assign]
    for name in PATHS:
        print(f"mean {name:9s} combine + backward {statistics.mean(combine[name]):6.1f} ms   "
              f"adaptation {statistics.mean(adapt[name]):6.2f} s")


if __name__ == "__main__":
    main()
