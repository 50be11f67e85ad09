"""Markdown tables from scripts/compare_methods.py output: mean (and std over seeds) per method.

    .venv/bin/python -m scripts.summarise_compare /tmp/compare.json [more.json ...]

Several files (e.g. one per inventory) are merged; columns are "inventory/method".
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def mean_std(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def per_seed_cell(rs: list[dict], seeds: list[int], key: str) -> str:
    """mean_std over seeds of `key`, over the records that have it ("-" where none do: the majority
    answer has no loss, generative tasks no log-likelihood ranking)."""
    per_seed = [statistics.mean(xs) for s in seeds if (xs := [r[key] for r in rs if r["seed"] == s and key in r])]
    return mean_std(per_seed) if per_seed else "-"


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: summarise_compare.py COMPARE.json [MORE.json ...]")
    records = [r for path in sys.argv[1:] for r in json.loads(Path(path).read_text())]
    by_method: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for r in records:
        r.setdefault("vocab", "legacy")  # records from before the open vocabulary
        by_method[(r["inventory"], r["method"], r["vocab"])].append(r)
    print("| inventory | method | words | tasks | runs | exact match (mean over tasks; ± std over seeds) |"
          " log-likelihood acc (multiple-choice tasks) | test loss | params adapted | stored bytes | adapt s (mean) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (inv, method, vocab), rs in sorted(by_method.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        seeds = sorted({r["seed"] for r in rs})
        per_seed_em = [statistics.mean(r["exact_match"] for r in rs if r["seed"] == s) for s in seeds]
        stored = f"{rs[0]['stored_bytes']:,}" if "stored_bytes" in rs[0] else "-"
        print(f"| {inv} | {method} | {vocab} | {len({r['task'] for r in rs})} | {len(rs)} | {mean_std(per_seed_em)} |"
              f" {per_seed_cell(rs, seeds, 'll_acc')} | {per_seed_cell(rs, seeds, 'loss')} | {rs[0]['params']:,} |"
              f" {stored} | {statistics.mean(r['adapt_seconds'] for r in rs):.1f} |")
    print()
    tasks = sorted({r["task"] for r in records})
    methods = list(dict.fromkeys((r["inventory"], r["method"], r["vocab"]) for r in records))
    print("| task | " + " | ".join(f"{inv}/{m}/{v}" for inv, m, v in methods) + " |")
    print("|---|" + "---|" * len(methods))
    for t in tasks:
        cells = []
        for m in methods:
            xs = [r["exact_match"] for r in records if r["task"] == t and (r["inventory"], r["method"], r["vocab"]) == m]
            cells.append(f"{statistics.mean(xs):.3f}" if xs else "-")
        print(f"| {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
