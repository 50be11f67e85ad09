"""Build the BIG-bench real-task suite from the bigbench==1.0.0 sdist, offline once it is fetched.

    .venv/bin/python -m scripts.bigbench_suite                      # fetch the sdist (358 MB), build the cache
    .venv/bin/python -m scripts.bigbench_suite --archive PATH.tar.gz   # from an archive already here

Writes $POLYSERVE_HOME/bigbench/{tasks.json,rows.jsonl} (training.bigbench: what the rows are, which
tasks are held out) and prints a summary. `--jsonl-out FILE` also writes the training tasks'
split-"train" rows as a suite file for `polyserve train --suite FILE` (`--one-per-source`: only each
source's largest task). The package itself is never installed: only its task.json files are read.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from training import bigbench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archive", type=Path, default=None,
                    help=f"a local {bigbench.ARCHIVE_NAME} (default: fetch it into the cache dir)")
    ap.add_argument("--out", type=Path, default=None, help="cache dir (default: $POLYSERVE_HOME/bigbench)")
    ap.add_argument("--jsonl-out", type=Path, default=None, help="also write the training rows as a suite file")
    ap.add_argument("--examples-per-task", type=int, default=500)
    ap.add_argument("--one-per-source", action="store_true",
                    help="--jsonl-out: only each BIG-bench source's task with the most training rows")
    ap.add_argument("--skip-checksum", action="store_true", help=argparse.SUPPRESS)  # tests' small archives
    args = ap.parse_args()

    archive = args.archive or bigbench.fetch_archive(args.out)
    if args.skip_checksum:
        out = bigbench.write_cache(bigbench.convert(archive), args.out or bigbench.cache_dir(), "unchecked")
    else:
        out = bigbench.build_cache(archive, args.out)
    tasks = bigbench.load_cache(out)
    held = [t for t in tasks if t.heldout]
    train = [t for t in tasks if not t.heldout]
    kinds = Counter(t.kind for t in tasks)
    print(f"{out}: {len(tasks)} tasks ({len(train)} training, {len(held)} held out: "
          f"{len({t.source for t in held})} BIG-Bench Hard sources); {dict(kinds)}")
    missing = sorted(set(bigbench.BBH_SOURCES) - {t.source for t in held})
    if missing:
        print(f"BIG-Bench Hard sources with no JSON task in the archive (programmatic tasks): {missing}")
    if args.jsonl_out:
        rows = bigbench.training_suite(args.examples_per_task, out, one_per_source=args.one_per_source)
        with args.jsonl_out.open("w") as f:
            for exs in rows.values():
                for ex in exs:
                    f.write(json.dumps(ex.to_dict()) + "\n")
        print(f"{args.jsonl_out}: {sum(map(len, rows.values()))} rows of {len(rows)} training tasks")


if __name__ == "__main__":
    main()
