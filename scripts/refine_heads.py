"""Copy a store with its inventory's routing heads refined (adapters_store.store.refine): every task
serves the same LoRA; routing-only adaptation on the copy learns finer rows (docs/RESULTS.md 9.9).

    .venv/bin/python -m scripts.refine_heads --from-store /tmp/shipped_store --to-store /tmp/h32_store --heads 32
"""

from __future__ import annotations

import argparse

from adapters_store.store.directory import DirectoryStore
from adapters_store.store.errors import StoreError
from adapters_store.store.refine import refine_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-store", required=True)
    ap.add_argument("--to-store", required=True, help="a new (empty) store directory")
    ap.add_argument("--heads", type=int, required=True, help="a multiple of the inventory's heads")
    args = ap.parse_args()
    src, dst = DirectoryStore(args.from_store), DirectoryStore(args.to_store)
    try:
        info = refine_store(src, dst, args.heads)
    except (StoreError, ValueError) as err:
        raise SystemExit(f"refine_heads: {err}") from err
    print(f"{args.to_store}: inventory {info.version}, h = {info.spec.n_heads} (from "
          f"{src.inventory_info().spec.n_heads}), {len(dst.list_tasks())} tasks")


if __name__ == "__main__":
    main()
