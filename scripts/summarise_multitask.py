"""Markdown table of multitask accuracy per pre-training method, from `polyserve eval --json-out`.

    .venv/bin/python -m scripts.summarise_multitask mhr=/tmp/m300/eval_mhr.json poly=/tmp/m300/eval_poly.json ...

Each argument is LABEL=EVAL.json. Tasks are grouped by how many primitives they compose
(task ids of the procedural suite join primitives with ".").
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    pairs = [a.split("=", 1) for a in sys.argv[1:]]
    if not pairs or any(len(p) != 2 for p in pairs):
        sys.exit("usage: summarise_multitask.py LABEL=EVAL.json [LABEL=EVAL.json ...]")
    print("| method | tasks | exact match, all | 1 primitive | 2 primitives | 3 primitives | test loss |"
          " Z discreteness / sparsity / usage |")
    print("|---|---|---|---|---|---|---|---|")
    for label, path in pairs:
        summary = json.loads(Path(path).read_text())
        rows = summary["tasks"]
        by_size: dict[int, list[float]] = {1: [], 2: [], 3: []}
        for name, row in rows.items():
            by_size.setdefault(name.count(".") + 1, []).append(row["exact_match"])
        cells = [f"{statistics.mean(v):.3f}" if v else "-" for _, v in sorted(by_size.items())]
        z = summary.get("z_stats")
        zs = f"{z['discreteness']:.3f} / {z['sparsity']:.3f} / {z['usage']:.3f}" if z else "-"
        loss = statistics.mean(r["loss"] for r in rows.values())
        em = statistics.mean(r["exact_match"] for r in rows.values())
        print(f"| {label} | {len(rows)} | {em:.3f} | " + " | ".join(cells) + f" | {loss:.3f} | {zs} |")
        by_vocab = summary.get("mean_exact_match_by_vocab")
        if by_vocab:
            print(f"|   {label}, by words | | " + ", ".join(f"{v} {x:.3f}" for v, x in by_vocab.items())
                  + " | | | | | |")


if __name__ == "__main__":
    main()
