"""One registration's work (retrieval from the store's tasks, then the default routing adaptation)
on the same held-out task and examples, timed for two or more stores' inventories alternating in
one process: what an inventory change costs a registration, with the host's drift spread evenly
over the stores. The inventories must have the same shape (they share one routed model; each
round loads its store's skills).

    .venv/bin/python -m bench.adapt_inventories --store /tmp/old_store --also /tmp/new_store --rounds 3 --threads 2

(each store: one made by training.shipped_inventory.install_default_inventory, from a checkout's
training/default_inventory/)
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import server  # noqa: F401  (before torch: OpenMP spin defaults, server/infra/openmp.py)

# isort: split
from adapters_store.store.directory import DirectoryStore
from bench.adaptation_setup import load, parser, run_to_end
from training.adapt import Adaptation
from training.adapt_config import AdaptConfig
from training.retrieve import MAX_CANDIDATES, Retrieval


def main() -> None:
    ap = parser(__doc__, rounds=3)
    ap.add_argument("--also", default="", help="comma-separated stores timed beside --store (the same shape)")
    ap.add_argument("--autocast", choices=["auto", "bf16", "none"], default="auto")
    s = load(ap.parse_args())
    stores = [s.store] + [DirectoryStore(p) for p in s.args.also.split(",") if p]
    args = s.args
    inventories = {}
    for store in stores:
        info, skills = store.load_inventory(s.info.backbone_fingerprint)
        if info.spec != s.info.spec or info.layer_names != s.info.layer_names:
            raise SystemExit(f"{store.root}: another inventory shape than {stores[0].root}")
        inventories[store.root] = (info, skills, {k: v.float() for k, v in skills.items()})
    times: dict[Path, list[tuple[float, float]]] = {st.root: [] for st in stores}
    for _ in range(args.rounds):
        for store in stores:
            info, skills, skills_f32 = inventories[store.root]
            s.rm.load_skills(skills)
            started = time.perf_counter()
            candidates = store.routing_rows(limit=MAX_CANDIDATES, exclude=s.task)
            retrieval = Retrieval(s.rm, info, candidates, s.few, s.tokenizer, seed=0, autocast=args.autocast)
            run_to_end(retrieval)
            retrieved = time.perf_counter() - started
            job = Adaptation(s.rm, info, skills_f32, s.few, s.tokenizer,
                             AdaptConfig(method="routing", seed=0, autocast=args.autocast),
                             init_row=retrieval.result().tensors["logits"])
            adapted = run_to_end(job)
            m = job.result().metrics
            times[store.root].append((retrieved, adapted))
            print(f"{store.root}: {len(candidates)} candidates, retrieval {retrieved:5.2f} s, adaptation "
                  f"{adapted:6.2f} s ({m['steps_run']} steps, best {m['best_step']}, eval loss "
                  f"{m['eval_loss']:.4f})", flush=True)
    print(f"{s.task}, {args.rounds} rounds alternating, {args.threads} threads, autocast {args.autocast}")
    for root, ts in times.items():
        r, a = statistics.mean(t[0] for t in ts), statistics.mean(t[1] for t in ts)
        print(f"mean {root}: retrieval {r:5.2f} s + adaptation {a:6.2f} s = {r + a:6.2f} s")


if __name__ == "__main__":
    main()
