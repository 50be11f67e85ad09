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
            xs = [r["exact_match"] for r in records
                  if r["task"] == t and (r["inventory"], r["method"], r["vocab"]) == m]
            cells.append(f"{statistics.mean(xs):.3f}" if xs else "-")
        print(f"| {t} | " + " | ".join(cells) + " |")
    auto_table(records)


def auto_table(records: list[dict]) -> None:
    """auto's choice beside what it was weighed against: per task and seed, the chosen form, its
    cross-validated estimate, the measured exact match, and the better of routing-r and icl."""
    autos = [r for r in records if r["method"] == "auto"]
    if not autos:
        return

    def measured(r: dict, method: str) -> float | None:
        return next((x["exact_match"] for x in records if x["method"] == method and x["task"] == r["task"]
                     and x["seed"] == r["seed"] and x.get("k") == r.get("k")), None)

    print()
    print("| task | seed | chosen | estimate | measured | routing-r | icl | demos+routing | auto - better of the two |")
    print("|---|---|---|---|---|---|---|---|---|")
    gaps, errors = [], []
    for r in sorted(autos, key=lambda r: (r["task"], r["seed"])):
        routing, icl, both = measured(r, "routing-r"), measured(r, "icl"), measured(r, "demos+routing")
        better = max(x for x in (routing, icl) if x is not None) if routing is not None or icl is not None else None
        gap = r["exact_match"] - better if better is not None else None
        gaps += [gap] if gap is not None else []
        errors.append(abs(r["cv_exact"] - r["exact_match"]))
        cells = [r["task"], r["seed"], r["chosen"], f"{r['cv_exact']:.3f}", f"{r['exact_match']:.3f}",
                 *(f"{x:.3f}" if x is not None else "-" for x in (routing, icl, both)),
                 f"{gap:+.3f}" if gap is not None else "-"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    worst = f", worst {min(gaps):+.3f}" if gaps else ""
    mean_gap = f"{statistics.mean(gaps):+.3f}" if gaps else "-"
    print(f"\nauto against the better of routing-r and icl: mean {mean_gap}{worst}; "
          f"estimate off the measured exact match by {statistics.mean(errors):.3f} on average")


if __name__ == "__main__":
    main()
