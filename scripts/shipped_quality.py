"""Measure every shipped task and write the figures into its packaged record.

    python -m scripts.shipped_quality --store STORE --threads 2 --json-out shipped.json
    python -m scripts.shipped_quality --from-json shipped.json      # write the figures only

The first form installs the shipped inventory into STORE (an empty directory, or one this script
filled before), every task included (those below the floor too), and runs the evaluator on each
shipped task (`polyserve eval`, training/evaluate.py: greedy exact match, 16 test inputs, seed 0):

    polyserve eval --store STORE --tasks <every shipped task> --n 16 --split test --seed 0 \\
        --vocabs heldout,sentences --threads 2 --json-out shipped.json

held-out English words for every task, and sentences (training.vocab.sentence, the held-out
templates no training input is made from) for the tasks of word-level primitives alone
(training.suite.takes_sentences). Then it
writes each task's `quality` ({"heldout_exact", "sentences_exact" where measured, "n",
"measured"}) into training/default_inventory/tasks/<id>/task.json and prints a summary: the means,
the primitives alone, and the tasks below the floor (training.shipped_inventory.QUALITY_FLOOR).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from adapters_store.store.atomic import atomic_write_json, read_json
from adapters_store.store.directory import DirectoryStore
from adapters_store.store.records import check_quality
from training.shipped_inventory import (
    OPT_IN_ENV,
    PACKAGE_DIR,
    QUALITY_FLOOR,
    install_default_inventory,
    refresh_shipped,
)
from training.suite import PRIMITIVES

N, SPLIT, SEED, VOCABS = 16, "test", 0, "heldout,sentences"


def shipped_tasks(package: Path = PACKAGE_DIR) -> list[str]:
    return sorted(p.parent.name for p in (package / "tasks").glob("*/task.json"))


def measure(store: Path, out: Path, threads: int, package: Path = PACKAGE_DIR) -> None:
    """Run the evaluator on every shipped task (installed first, below the floor too)."""
    target = DirectoryStore(store)
    install_default_inventory(target, source=package, below_floor_too=True)
    refresh_shipped(target, source=package, below_floor_too=True)  # a store installed with the floor before
    cmd = [sys.executable, "-m", "server.cli", "eval", "--store", str(store),
           "--tasks", ",".join(shipped_tasks(package)), "--n", str(N), "--split", SPLIT, "--seed", str(SEED),
           "--vocabs", VOCABS, "--threads", str(threads), "--json-out", str(out)]
    subprocess.run(cmd, check=True, env={**os.environ, OPT_IN_ENV: "1"}, stdout=subprocess.DEVNULL)


def quality_of(row: dict[str, Any], n: int, measured: str) -> dict[str, Any]:
    """One task's `quality` from its row of the evaluator's JSON."""
    by_vocab = row["by_vocab"]
    quality: dict[str, Any] = {"heldout_exact": by_vocab["heldout"]["exact_match"], "n": n, "measured": measured}
    if "sentences" in by_vocab:
        quality["sentences_exact"] = by_vocab["sentences"]["exact_match"]
    return check_quality(quality)


def write(results: dict[str, Any], measured: str, package: Path = PACKAGE_DIR) -> dict[str, dict[str, Any]]:
    """Each shipped task's quality into its task.json; every shipped task must have been measured."""
    rows, n = results["tasks"], int(results["n"])
    missing = sorted(set(shipped_tasks(package)) - set(rows))
    if missing or results.get("split") != SPLIT:
        raise SystemExit(f"the results do not measure every shipped task on split {SPLIT!r}: missing {missing[:5]}")
    out = {}
    for task in shipped_tasks(package):
        path = package / "tasks" / task / "task.json"
        data = read_json(path)
        data["quality"] = out[task] = quality_of(rows[task], n, measured)
        atomic_write_json(path, data)
    return out


def summary(quality: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    words = {t: q for t, q in quality.items() if "sentences_exact" in q}
    below = sorted(t for t, q in quality.items() if q["heldout_exact"] < QUALITY_FLOOR)
    return {
        "tasks": len(quality), "heldout_exact": mean([q["heldout_exact"] for q in quality.values()]),
        "word_level_tasks": len(words),
        "word_level_heldout_exact": mean([q["heldout_exact"] for q in words.values()]),
        "word_level_sentences_exact": mean([q["sentences_exact"] for q in words.values()]),
        "floor": QUALITY_FLOOR, "below_floor": len(below),
        "below_floor_by_length": {k: sum(t.count(".") + 1 == k for t in below) for k in (1, 2, 3)},
        "primitives": {p: {k: quality[p].get(k) for k in ("heldout_exact", "sentences_exact")}
                       for p in PRIMITIVES if p in quality},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", type=Path, help="a store to measure in (installed here if empty)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", type=Path, help="where the evaluator writes its results")
    ap.add_argument("--from-json", type=Path, help="write the figures of an earlier run instead of measuring")
    ap.add_argument("--measured", default=None, help="the date of the measurement (default: the results file's)")
    args = ap.parse_args()
    if args.from_json:
        results_path = args.from_json
    elif args.store and args.json_out:
        measure(args.store, args.json_out, args.threads)
        results_path = args.json_out
    else:
        ap.error("--store and --json-out, or --from-json")
    measured = args.measured or datetime.datetime.fromtimestamp(results_path.stat().st_mtime, datetime.UTC).date()
    quality = write(json.loads(results_path.read_text()), str(measured))
    print(json.dumps(summary(quality), indent=2))


if __name__ == "__main__":
    main()
